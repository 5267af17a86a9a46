"""Benchmark: weight-file hashing speed from the page cache, and the memo that skips it.

    python loadtests/bench_fingerprint.py [--gib 2] [--dir /tmp]

Writes a file of pseudo-random bytes, reads it once to warm the page cache, then times
`hash_file` (xxh3_128, 16 MiB reads) and a memo lookup of the same file. Target: >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from cacheproxy.keys.digests import DigestMemo, hash_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    size = int(args.gib * (1 << 30))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "model.safetensors"
        block = os.urandom(16 << 20)
        with path.open("wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
        size = path.stat().st_size
        hash_file(path)  # warm the page cache
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            hash_file(path)
            runs.append(time.perf_counter() - start)
        memo = DigestMemo(Path(tmp) / "digests.json")
        memo.digest(path)
        start = time.perf_counter()
        DigestMemo(Path(tmp) / "digests.json").digest(path)
        lookup = time.perf_counter() - start
    best = min(runs)
    print("| file | best of 3 | throughput | memo lookup |")
    print("|---|---|---|---|")
    print(f"| {size / 1e9:.2f} GB | {best:.3f} s | {size / best / 1e9:.2f} GB/s | "
          f"{lookup * 1000:.2f} ms |")


if __name__ == "__main__":
    main()
