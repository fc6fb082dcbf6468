"""Protocol definitions and the generated code (``generate.sh`` regenerates it; never edit the
``*_pb2*.py`` files by hand). ``options`` holds the channel settings both sides must agree on."""
