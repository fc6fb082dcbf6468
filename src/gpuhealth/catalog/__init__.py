"""Data, not code: the XID catalog (``xid.csv``) and the thresholds (``thresholds``), each with its
source named. Loaders here parse and validate the files; collectors only look things up."""
