"""Compare two `sm120patch bench --check-only --json` documents case by case: are the fused
outputs bit-identical (sha256 of the norm and residual outputs of rank 0), and how far is each
from the NCCL + float32 RMSNorm reference?

    python benchmarks/compare_exactness.py pristine.json patched.json
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    pristine, patched = (json.load(open(path)) for path in argv)
    key = lambda c: (c["hidden"], c["tokens"], c["strategy"])  # noqa: E731
    a, b = {key(c): c for c in pristine["cases"]}, {key(c): c for c in patched["cases"]}
    if a.keys() != b.keys():
        print("the two documents cover different cases")
        return 1
    tol = patched["tolerance"]
    print(f"{pristine['dtype']}: flashinfer {pristine['flashinfer']} pristine vs patched, world size "
          f"{patched['world_size']}, {patched['device']} (compute capability {patched['capability']}); "
          f"tolerance |err| <= {tol['atol']:g} + {tol['rtol']:g}·|ref|")
    print("| hidden | tokens | path | pristine max err | patched max err | both within tolerance | bit-identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    identical = within = 0
    worst = 0.0
    for k in sorted(a):
        p, q = a[k], b[k]
        same = p["digests"] == q["digests"]
        ok = p["ok"] and q["ok"]
        identical += same
        within += ok
        err_p = max(p["max_err_norm"], p["max_err_residual"])
        err_q = max(q["max_err_norm"], q["max_err_residual"])
        worst = max(worst, err_p, err_q)
        print(f"| {k[0]} | {k[1]} | {q['effective_strategy']} | {err_p:.4g} | {err_q:.4g} | {'yes' if ok else 'NO'} | "
              f"{'yes' if same else 'NO'} |")
    print(f"{identical} of {len(a)} cases bit-identical; {within} of {len(a)} within tolerance in both; "
          f"largest error seen {worst:.4g}")
    return 0 if identical == within == len(a) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
