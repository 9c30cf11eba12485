"""Device check of the split-KV decode kernels (docs/DECODING.md) against float64.

Eight configs (the default, fixed split counts 1/7/33, the split rule with multipliers 1/2/4,
tiles of 32/64/128 keys; ``--configs`` names others), on ragged lengths, contiguous and paged caches (pages out of order, one shared),
appends, Nq 1 and 4, head dims 64 and 128, float16 and bfloat16; with windows, softcap and ALiBi
on a few configs. FlashAttention's 2x rule: the kernel's max error against the float64
definition (tests/_decode_oracle.py, run on the CPU) is at most twice SDPA's error in the same
dtype on the sliced cache (where SDPA can run the case; else the definition computed in float32
and rounded to the dtype), plus 1e-3; the caches after the call must equal the expected
appends bit for bit. ``--all`` checks the whole tuning space (``DECODE_SPACE``) on the plain
cases. Writes a log to ``--out`` and exits non-zero on any failure.

    PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_check_decode.py --out $OUT/dec.log
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sparktune  # noqa: E402
from sparktune.kernels import triton_decode_space as space  # noqa: E402
from tests._decode_cases import make_case  # noqa: E402
from tests._decode_oracle import decode_oracle, expected_caches  # noqa: E402

FLOOR = 1e-3


def cases(dtype):
    """(label, make_case kwargs, feature case?)"""
    out = []
    for d in (64, 128):
        for nq in (1, 4):
            for paged in (0, 16):
                out.append((f"d{d}_nq{nq}_page{paged}", dict(
                    batch=4, nq=nq, hq=8, hkv=2, d=d, seqlens=(700, 0, 1, 1023 - nq),
                    capacity=1024, appends=nq, page_size=paged, share_pages=False), False))
    out.append(("page64", dict(batch=3, nq=1, hq=8, hkv=2, d=128, seqlens=(300, 200, 5),
                               capacity=512, page_size=64, appends=1), False))
    out.append(("page256_window", dict(batch=3, nq=2, hq=8, hkv=2, d=128, seqlens=(700, 0, 1000),
                                       capacity=1024, page_size=256, appends=2,
                                       window=(300, -1)), False))
    out.append(("shared_pages", dict(batch=3, nq=1, hq=8, hkv=2, d=128, seqlens=(300, 200, 5),
                                     capacity=512, page_size=64, share_pages=True), False))
    out.append(("batch_idx", dict(batch=3, nq=1, hq=8, hkv=2, d=128, seqlens=(300, 200, 5),
                                  capacity=512, batch_idx=True, appends=1), False))
    out.append(("gqa_32_8", dict(batch=2, nq=1, hq=32, hkv=8, d=128, seqlens=(900, 33),
                                 capacity=1024, appends=1), False))
    out.append(("window", dict(batch=3, nq=4, hq=8, hkv=2, d=128, seqlens=(600, 3, 1000),
                               capacity=1024, appends=4, page_size=16, window=(127, -1)), True))
    out.append(("softcap", dict(batch=3, nq=1, hq=8, hkv=2, d=128, seqlens=(600, 3, 1000),
                                capacity=1024, softcap=30.0), True))
    out.append(("alibi", dict(batch=3, nq=2, hq=8, hkv=2, d=64, seqlens=(600, 3, 1000),
                              capacity=1024, alibi=True), True))
    return [(label, dict(kw, dtype=dtype), feat) for label, kw, feat in out]


def run_case(label, spec, configs, log, dev):
    spec = dict(spec)
    alibi = spec.pop("alibi", False)
    case = make_case(seed=abs(hash(label)) % 997, **spec)
    if alibi:
        case.kwargs["alibi_slopes"] = torch.rand(case.q.shape[2],
                                                 generator=torch.Generator().manual_seed(3))
    kw = case.kwargs
    okw = dict(seqlens=case.seqlens, table=case.table, batch_idx=case.batch_idx,
               causal=kw.get("causal", True), scale=kw.get("scale"),
               window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
               slopes=kw.get("alibi_slopes"))
    t0 = time.time()
    ref, ref_lse = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v, **okw)
    kc_exp, vc_exp = expected_caches(case.k_cache, case.v_cache, case.k, case.v, case.seqlens,
                                     case.table, case.batch_idx)
    if "alibi_slopes" in kw:
        case.kwargs["alibi_slopes"] = kw["alibi_slopes"].to(dev)
    if kw.get("softcap", 0.0) > 0:
        low, _ = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v,
                               math_dtype=torch.float32, **okw)
        base, base_name = (low.to(case.q.dtype).double() - ref).abs().max().item(), "fp32-def"
    else:
        args, ckw = case.call_args(dev)
        sd = sparktune.attention_with_kvcache(*args, **ckw, backend="torch")
        base, base_name = (sd.double().cpu() - ref).abs().max().item(), "sdpa"
    log(f"# {label}: oracle {time.time() - t0:.1f}s, baseline ({base_name}) {base:.2e}")
    failures = 0
    for config in configs:
        args, ckw = case.call_args(dev)
        try:
            out, lse = sparktune.attention_with_kvcache(*args, **ckw, backend="triton",
                                                       config=config, return_lse=True)
            torch.cuda.synchronize()
            err = (out.double().cpu() - ref).abs().max().item()
            fin = ~torch.isinf(ref_lse)
            lse_cpu = lse.double().cpu()
            lse_err = (lse_cpu[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
            inf_ok = torch.equal(torch.isinf(lse_cpu), torch.isinf(ref_lse))
            cache_ok = torch.equal(args[1].cpu(), kc_exp) and torch.equal(args[2].cpu(), vc_exp)
            ok = err <= 2 * base + FLOOR and lse_err <= 1e-2 and inf_ok and cache_ok
        except Exception:  # noqa: BLE001 - reported in the log
            ok, err, lse_err, cache_ok = False, float("nan"), float("nan"), False
            log(traceback.format_exc())
        failures += not ok
        log(f"{'PASS' if ok else 'FAIL'} {label} {config} err {err:.2e} (limit "
            f"{2 * base + FLOOR:.2e}) lse {lse_err:.1e} cache {'ok' if cache_ok else 'WRONG'}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the log file")
    ap.add_argument("--all", action="store_true", help="every config of DECODE_SPACE")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--configs", default="", help="comma-separated config names (plain cases)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    fh = open(args.out, "w")

    def log(line):
        print(line, flush=True)
        fh.write(line + "\n")
        fh.flush()

    log(f"device {torch.cuda.get_device_name(dev)}; torch {torch.__version__}")
    plain = [space.default_decode_config(128), "tdec_n32_w4s2_p1", "tdec_n64_w4s2_p7",
             "tdec_n128_w8s3_p33", "tdec_n64_w4s2_x1", "tdec_n128_w8s3_x4", "tdec_n128_w4s3_x2",
             "tdec_n64_w8s2_x4", "tdec_n128_w4s3_x8"]
    if args.configs:
        plain = args.configs.split(",")
    if args.all:
        plain = list(dict.fromkeys(list(space.DECODE_SPACE) + plain))
    featured = [space.default_decode_config(128), "tdec_n64_w4s2_p7", "tdec_n128_w8s3_p1"]
    failures = 0
    t0 = time.time()
    for dt in args.dtypes.split(","):
        for label, spec, feat in cases(getattr(torch, dt)):
            failures += run_case(f"{dt}_{label}", spec, featured if feat else plain, log, dev)
    log(f"{'OK' if not failures else 'FAILED'}: {failures} failures in {time.time() - t0:.0f}s")
    fh.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
