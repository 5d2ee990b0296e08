"""How fast a model file is hashed for the infotext (sdfarm.native.filehash), the cost a worker
pays once per file version: `python bench/file_hash.py FILE [FILE...]` prints MB/s per file."""

from __future__ import annotations

import json
import os
import sys
import time

from sdfarm.native.filehash import sha256_of


def main(paths: list[str]) -> int:
    for path in paths:
        t = time.monotonic()
        digest = sha256_of(path)
        s = time.monotonic() - t
        size = os.path.getsize(path)
        row = {"file": os.path.basename(path), "bytes": size, "seconds": round(s, 2),
               "mb_per_s": round(size / s / 1e6), "model_hash": digest[:10]}  # fmt: skip
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
