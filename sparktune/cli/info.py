"""``sparktune info``: what this installation can run, and why not where it cannot."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

__all__ = ["add_parser", "collect", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "info", help="show the build, the GPU and the backends", description=__doc__
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)
    return parser


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _build() -> dict[str, Any]:
    try:
        _C = importlib.import_module("sparktune._C")
    except Exception as exc:  # noqa: BLE001 - a missing or broken extension is reported
        return {"compiled": False, "reason": _error(exc)}
    build: dict[str, Any] = {"compiled": True}
    try:
        meta = dict(_C.build_info())
        kernels = [k["name"] for k in _C.kernels()]
        excluded = list(_C.excluded())
    except Exception as exc:  # noqa: BLE001
        build["error"] = f"sparktune._C imports but cannot describe itself: {_error(exc)}"
        return build
    build.update(
        version=meta.get("version"),
        cuda_version=meta.get("cuda_version"),
        archs=list(meta.get("archs", [])),
        build_id=meta.get("build_id"),
        kernel_filter=meta.get("kernel_filter"),
        kernel_count=len(kernels),
        kernels=kernels,
        excluded_count=len(excluded),
    )
    return build


def _gpus() -> dict[str, Any]:
    import torch

    if torch.version.cuda is None:
        return {"devices": [], "reason": f"torch {torch.__version__} is built without CUDA"}
    if not torch.cuda.is_available():
        return {"devices": [], "reason": "torch sees no CUDA device"}
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "capability": [props.major, props.minor],
                "sm_count": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1),
            }
        )
    return {"devices": devices}


def _backends() -> dict[str, Any]:
    from ..registry import backends

    report = {}
    for name, backend in backends().items():
        try:
            reasons = list(backend.unavailable_reasons())
            configs = list(backend.configs("fwd")) if not reasons else []
            features = sorted(backend.features) if not reasons else []
        except Exception as exc:  # noqa: BLE001 - a backend that raises here is reported
            reasons, configs = [f"error while asking the backend: {_error(exc)}"], []
            features = []
        report[name] = {
            "available": not reasons,
            "reasons": reasons,
            "tunable": bool(backend.tunable),
            "configs": configs,
            # the attention features it takes (docs/FEATURES.md)
            "features": features,
        }
    return report


def collect() -> dict[str, Any]:
    """Everything ``sparktune info`` reports, as plain data."""
    import torch

    from .. import __version__

    return {
        "version": __version__,
        "build": _build(),
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
        },
        "gpu": _gpus(),
        "backends": _backends(),
    }


def _format(info: dict[str, Any]) -> str:
    lines = [f"sparktune {info['version']}"]
    build = info["build"]
    if not build["compiled"]:
        lines.append(
            f"build:    WARNING: pure-Python install: no compiled kernels ({build['reason']})"
        )
    elif "error" in build:
        lines.append(f"build:    WARNING: {build['error']}")
    else:
        archs = ", ".join(f"sm_{a}" for a in build["archs"]) or "none"
        lines.append(
            f"build:    CUDA {build['cuda_version']}, archs {archs}, build id {build['build_id']}"
            + (f", kernels {build['kernel_filter']!r}" if build.get("kernel_filter")
               else ", the default kernels (each default and the shipped winners; "
               "SPARKTUNE_KERNELS=all builds every configuration)")
        )
        lines.append(
            f"kernels:  {build['kernel_count']} compiled, {build['excluded_count']} configs "
            "excluded by the compile-time rules"
        )
        lines.extend(f"          {name}" for name in build["kernels"])
    t = info["torch"]
    lines.append(
        f"torch:    {t['version']} (CUDA {t['cuda'] or 'none'}; CUDA available: "
        f"{'yes' if t['cuda_available'] else 'no'})"
    )
    gpu = info["gpu"]
    if not gpu["devices"]:
        lines.append(f"GPU:      no GPU ({gpu['reason']})")
    for d in gpu["devices"]:
        major, minor = d["capability"]
        lines.append(
            f"GPU {d['index']}:    {d['name']}, sm_{major}{minor}, {d['sm_count']} SMs, "
            f"{d['memory_gib']} GiB"
        )
    lines.append("backends:")
    width = max((len(n) for n in info["backends"]), default=0)
    for name, b in info["backends"].items():
        if b["available"]:
            state = f"available ({len(b['configs'])} configs: {', '.join(b['configs'][:8])}"
            state += ", ...)" if len(b["configs"]) > 8 else ")"
            if b.get("features"):
                state += f"; features: {', '.join(b['features'])}"
        else:
            state = "unavailable: " + "; ".join(b["reasons"])
        lines.append(f"  {name:<{width}}  {state}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    info = collect()
    print(json.dumps(info, indent=2) if args.json else _format(info))
    return 0
