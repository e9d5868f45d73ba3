"""`python -m hf_kvcache.calibration ...` is `hf-kvcache calibrate ...`."""

import sys

from hf_kvcache.cli import main

if __name__ == "__main__":
    sys.exit(main(["calibrate", *sys.argv[1:]]))
