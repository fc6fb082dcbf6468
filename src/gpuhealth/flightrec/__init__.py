"""Flight-recorder analysis: load per-rank dumps safely, match collectives across ranks, and give
one verdict per job (see :func:`gpuhealth.flightrec.verdict.triage`)."""
