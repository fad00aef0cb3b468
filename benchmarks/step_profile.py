"""Where the study's train step goes (issue 74): a profile of one run's step, by group of
operations, its share of the step against its share of the FLOPs.

    python benchmarks/step_profile.py [--steps 20] [--warmup 5] [-- overrides...]

The step is the study's (`experiment=study_mega +arm=baseline`, the overrides after it), the
train step's core (`train/step.py: train_step_core`) jitted alone on one device and called on a
fixed batch of random tokens, as `benchmarks/members.py --step` builds it (its `members_of`,
one member). After the warm-up steps it runs `--steps` steps unprofiled, then `--steps` + 1 under
`jax.profiler.trace` (perfetto trace JSON). XLA's CPU runtime records one event per executed
thunk (an HLO instruction of the compiled module: a fusion, a YNNPACK fusion, a copy ...) with
its `hlo_op`; each is matched to its instruction in the compiled module's HLO text, which gives
its FLOPs (counted from the shapes: 2 per multiply-add of a dot, 1 per element of an
elementwise op, 1 per reduced input element; checked against the executable's
`cost_analysis()`) and its source stack frames (the Python functions that emitted it), which
give its group. A step is the span from one call's dispatch to the next's; the time in it
that no op covers is the host's (dispatch, the executor's gaps between ops, the wait and the
Python loop). Where two ops run at once (the executor runs independent thunks on two threads)
each is given half of that time, so the groups and the host sum to the step.

The data a run's loop reads each step (the next batch of the study's dataset, put on the
device) is not in the core: it is timed apart, on its own, in the same run. The matmul
throughput of this machine is measured in the same run too: one float32 1024x1024x1024 matmul
and one at the step's own commonest dense shape.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import writes_page  # noqa: E402
from members import members_of  # noqa: E402

STUDY = ["experiment=study_mega", "+arm=baseline"]

# --- the compiled module's HLO text ----------------------------------------------------------

ELEMENTWISE = set(
    "add subtract multiply divide maximum minimum compare select and or xor not negate abs exp "
    "exponential exponential-minus-one log log-plus-one tanh rsqrt sqrt cbrt power erf logistic clamp "
    "floor ceil sign cosine sine tan atan2 remainder round-nearest-even round-nearest-afz is-finite".split()
)
MOVEMENT = set(
    "parameter constant broadcast reshape bitcast transpose copy slice dynamic-slice dynamic-update-slice "
    "concatenate pad iota convert gather tuple get-tuple-element reverse".split()
)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = ")
_DIMS = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def _shape_and_rest(text: str) -> tuple[str, str]:
    """Split 'SHAPE opcode(...)...' where SHAPE may be a (nested) tuple."""
    if text.startswith("("):
        depth = 0
        for i, c in enumerate(text):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                return text[: i + 1], text[i + 2 :]
    shape, _, rest = text.partition(" ")
    return shape, rest


def elements(shape: str) -> int:
    """Elements of an array shape (of its first array, for a tuple)."""
    m = _DIMS.search(shape)
    return math.prod(int(d) for d in m[1].split(",") if d) if m else 1


def dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(d) for d in m[1].split(",") if d] if m else []


def parse_hlo(text: str) -> tuple[str, dict, dict]:
    """(entry computation name, computations {name: {instr: (shape, opcode, line)}}, stack frames
    {id: [(file, function), ... innermost first]}) of a compiled module's `as_text()`."""
    comps: dict[str, dict] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) \(", line)
        if head and line.rstrip().endswith("{"):
            current = comps.setdefault(head[2], {})
            entry = head[2] if head[1] else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if current is not None and m:
            shape, rest = _shape_and_rest(line[m.end() :])
            current[m[1]] = (shape, rest.split("(", 1)[0], line)

    def table(name: str) -> list[str]:
        part = text.split(f"\n{name}\n", 1)
        return part[1].split("\n\n", 1)[0].splitlines() if len(part) == 2 else []

    files = {int(x.split()[0]): x.split(None, 1)[1].strip('"') for x in table("FileNames")}
    funcs = {int(x.split()[0]): x.split(None, 1)[1].strip('"') for x in table("FunctionNames")}
    locs = {}
    for x in table("FileLocations"):
        m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", x)
        locs[int(m[1])] = (files.get(int(m[2]), "?"), funcs.get(int(m[3]), "?"))
    parents = {}
    for x in table("StackFrames"):
        m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", x)
        parents[int(m[1])] = (int(m[2]), int(m[3]))
    frames = {}
    for fid in parents:
        chain, f = [], fid
        while f in parents and len(chain) < 200:  # parent_frame_id is the parent's id + 1; 0: none
            loc, parent = parents[f]
            chain.append(locs.get(loc, ("?", "?")))
            f = parent - 1
        frames[fid] = chain
    return entry, comps, frames


def _called(line: str) -> list[str]:
    return re.findall(r"(?:calls|body|condition|branch_computations)=\{?%([\w.\-]+)", line)


def instr_cost(comps: dict, instrs: dict, shape: str, opcode: str, line: str, seen: set) -> dict:
    """FLOPs, dots ((lhs dims, rhs dims, out dims, flops)) and opcodes of one instruction of a
    computation (`instrs`, for its operands' shapes), and of what it calls."""
    out = {"flops": 0, "dots": [], "opcodes": {opcode}}
    operands = re.findall(r"%([\w.\-]+)", line.split(f"{opcode}(", 1)[-1].split(")", 1)[0])
    operand_shape = lambda i: instrs[operands[i]][0] if len(operands) > i and operands[i] in instrs else ""  # noqa: E731
    if opcode == "dot":
        lhs, rhs = dims(operand_shape(0)), dims(operand_shape(1))
        contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        k = math.prod(lhs[int(i)] for i in contract[1].split(",") if i) if contract and lhs else 1
        flops = 2 * elements(shape) * k
        out["flops"] += flops
        out["dots"].append((tuple(lhs), tuple(rhs), tuple(dims(shape)), flops))
    elif opcode in ELEMENTWISE:
        out["flops"] += elements(shape)
    elif opcode in ("reduce", "reduce-window"):
        out["flops"] += elements(operand_shape(0) or shape)
    elif opcode in ("scatter", "select-and-scatter"):
        out["flops"] += elements(operand_shape(len(operands) - 1) or shape)
    if opcode not in ("reduce", "scatter", "sort", "reduce-window", "select-and-scatter", "all-reduce"):
        for callee in _called(line):  # a reduce's to_apply is counted per element above
            sub = op_cost(comps, callee, seen)
            out["flops"] += sub["flops"]
            out["dots"] += sub["dots"]
            out["opcodes"] |= sub["opcodes"]
    out["opcodes"].discard("fusion")
    return out


def op_cost(comps: dict, comp: str, seen: set) -> dict:
    """instr_cost summed over a computation's instructions."""
    out = {"flops": 0, "dots": [], "opcodes": set()}
    if comp in seen or comp not in comps:
        return out
    seen.add(comp)
    instrs = comps[comp]
    for shape, opcode, line in instrs.values():
        sub = instr_cost(comps, instrs, shape, opcode, line, seen)
        out["flops"] += sub["flops"]
        out["dots"] += sub["dots"]
        out["opcodes"] |= sub["opcodes"]
    return out


# --- groups ------------------------------------------------------------------------------------

GROUPS = [
    "dense matmuls (projections, FFN, logits)",
    "attention matmuls (QK^T, PV)",
    "attention softmax, masks, scaling",
    "norms (LayerNorm, fwd + bwd)",
    "FFN activation (GeLU, GLU)",
    "loss (cross-entropy)",
    "embeddings (gather, scatter-add)",
    "optimizer update (clip, Adam, apply)",
    "step metrics (grad norms)",
    "copies, transposes, broadcasts",
    "other elementwise (residuals, ...)",
]
ATTENTION_FUNCS = {"attention", "Attention._attend", "attention_logits", "Attention.__call__"}


def group_of(cost: dict, chain: list[tuple[str, str]]) -> str:
    funcs = {f for _, f in chain}
    files = [f for f, _ in chain]
    if cost["dots"]:
        inner = next((f for f in (fn for _, fn in chain) if f not in ("Linear.__call__",)), None)
        return GROUPS[1] if chain and chain[0][1] != "Linear.__call__" and inner in ATTENTION_FUNCS else GROUPS[0]
    if cost["opcodes"] <= MOVEMENT:
        if funcs & {"Embed.__call__", "Seq2Seq.decoder_inputs"} or "scatter" in cost["opcodes"]:
            return GROUPS[6]
        return GROUPS[9]
    if "train_metrics" in funcs:
        return GROUPS[8]
    if any("/optax/" in f and "/losses/" not in f for f in files) or any("/dalle_ablate/optim/" in f for f in files):
        return GROUPS[7]
    if funcs & {"Norm.__call__", "LayerNorm.__call__", "RMSNorm.__call__"}:
        return GROUPS[3]
    if funcs & ATTENTION_FUNCS:
        return GROUPS[2]
    if funcs & {"Embed.__call__", "Seq2Seq.decoder_inputs"} or "scatter" in cost["opcodes"]:
        return GROUPS[6]
    if funcs & {"FeedForward.__call__"}:
        return GROUPS[4]
    if chain and ("/optax/losses/" in chain[0][0] or chain[0][1] in ("stream_nll", "objective", "Seq2Seq.nll")):
        return GROUPS[5]
    return GROUPS[10]


def entry_ops(text: str) -> tuple[dict, str]:
    """{entry instruction name: {group, flops, dots, shape, opcode}} and the module's name."""
    module = re.match(r"HloModule (\S+?),", text)[1]
    entry, comps, frames = parse_hlo(text)
    ops = {}
    for name, (shape, opcode, line) in comps[entry].items():
        if opcode in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
            continue
        cost = instr_cost(comps, comps[entry], shape, opcode, line, set())
        frame = re.search(r"stack_frame_id=(\d+)", line)
        chain = frames.get(int(frame[1]), []) if frame else []
        ops[name] = {
            "group": group_of(cost, chain),
            "flops": cost["flops"],
            "dots": cost["dots"],
            "shape": shape,
            "opcode": opcode,
            "opcodes": cost["opcodes"],
        }
    return ops, module


# --- the trace ---------------------------------------------------------------------------------


def read_trace(folder: str) -> list[dict]:
    paths = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"no perfetto_trace.json.gz under {folder}")
    data = json.load(gzip.open(paths[0]))
    return data["traceEvents"] if isinstance(data, dict) else data


def steps_of(events: list[dict], module: str) -> list[dict]:
    """Each profiled call's window (dispatch to the next call's dispatch) with its ops' intervals."""
    calls = sorted(
        (e for e in events if e.get("ph") == "X" and e["name"].startswith("PjitFunction")), key=lambda e: e["ts"]
    )
    outer, end = [], -1.0
    for e in calls:  # PjitFunction events nest: keep the outermost
        if e["ts"] >= end:
            outer.append(e)
            end = e["ts"] + e["dur"]
    ops = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module and "hlo_op" in e["args"]
        ),
        key=lambda e: e["ts"],
    )
    windows = []
    for a, b in zip(outer, outer[1:]):
        inside = [e for e in ops if a["ts"] <= e["ts"] < b["ts"]]
        windows.append({"start": a["ts"], "end": b["ts"], "ops": inside})
    return windows


def attribute(window: dict) -> tuple[dict, float, float, float]:
    """({op: wall µs given to it}, lead, gaps, tail µs): concurrent ops share their overlap equally."""
    points = sorted({p for e in window["ops"] for p in (e["ts"], e["ts"] + e["dur"])})
    given: dict[str, float] = collections.defaultdict(float)
    busy = 0.0
    spans = [(e["ts"], e["ts"] + e["dur"], e["args"]["hlo_op"]) for e in window["ops"]]
    j, active = 0, []
    for lo, hi in zip(points, points[1:]):
        while j < len(spans) and spans[j][0] <= lo:
            active.append(spans[j])
            j += 1
        active = [s for s in active if s[1] > lo]
        now = [s for s in active if s[0] <= lo < s[1]]
        if now:
            busy += hi - lo
            for s in now:
                given[s[2]] += (hi - lo) / len(now)
    if not window["ops"]:
        return given, window["end"] - window["start"], 0.0, 0.0
    first = window["ops"][0]["ts"]
    last = max(e["ts"] + e["dur"] for e in window["ops"])
    lead, tail = first - window["start"], window["end"] - last
    return given, lead, (last - first) - busy, tail


# --- measurements apart ------------------------------------------------------------------------


def matmul_rate(m: int, k: int, n: int, reps: int = 20) -> float:
    """GFLOP/s of one jitted float32 (m,k)@(k,n), its fastest of reps (the least disturbed by other
    processes on a shared machine)."""
    import jax
    import jax.numpy as jnp

    a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / min(times) / 1e9


def data_times(run, n: int) -> list[float]:
    """Seconds per batch of the study's own data path, as the loop reads it: the next batch of
    the dataset's train iterator, put on the device."""
    import jax

    from dalle_ablate.data import build_dataset

    dataset = build_dataset(run.cfg.data, run.cfg.model)
    it = dataset.train_batches(run.cfg.trainer.batch_size, run.cfg.seed)
    jax.block_until_ready(jax.device_put(next(it)))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(next(it)))
        times.append(time.perf_counter() - t)
    return times


# --- main --------------------------------------------------------------------------------------


@writes_page("Where the study's train step goes: a profile")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="profiled steps (and as many unprofiled)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import jax

    from dalle_ablate.model.flops import train_flops_per_example

    run, core, states, batches, keys = members_of([*STUDY, *args.overrides], 1)
    state, batch, key = states[0], batches[0], keys[0]
    exe = jax.jit(core).lower(state, batch, key).compile()
    text = exe.as_text()
    ops, module = entry_ops(text)
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    bs = run.cfg.trainer.batch_size
    model_flops = train_flops_per_example(run.model_cfg) * bs

    for _ in range(args.warmup):
        jax.block_until_ready(exe(state, batch, key))
    plain = []
    for _ in range(args.steps):
        t = time.perf_counter()
        jax.block_until_ready(exe(state, batch, key))
        plain.append(time.perf_counter() - t)
    folder = tempfile.mkdtemp(prefix="step-profile-")
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(args.steps + 1):  # n + 1 calls: n windows, dispatch to dispatch
            jax.block_until_ready(exe(state, batch, key))
    windows = steps_of(read_trace(folder), module)
    data = data_times(run, args.steps)
    peak = matmul_rate(1024, 1024, 1024, reps=30)

    # Per op: wall given to it (mean over steps) and its own fastest duration.
    given: dict[str, float] = collections.defaultdict(float)
    durations: dict[str, list[float]] = collections.defaultdict(list)
    lead = gaps = tail = 0.0
    unknown = set()
    for w in windows:
        g, a, b, c = attribute(w)
        lead, gaps, tail = lead + a, gaps + b, tail + c
        for op, us in g.items():
            given[op] += us
        per_step = collections.defaultdict(float)
        for e in w["ops"]:
            per_step[e["args"]["hlo_op"]] += e["dur"]
        for op, us in per_step.items():
            durations[op].append(us)
            if op not in ops:
                unknown.add(op)
    n = len(windows)
    step_us = statistics.mean(w["end"] - w["start"] for w in windows)
    counts = collections.Counter(op for w in windows for op in {e["args"]["hlo_op"] for e in w["ops"]})
    flops_total = sum(o["flops"] for o in ops.values())

    rows = {g: {"us": 0.0, "fast_us": 0.0, "flops": 0, "ops": 0} for g in [*GROUPS, "not in the HLO text"]}
    for op, us in given.items():
        g = ops[op]["group"] if op in ops else "not in the HLO text"
        rows[g]["us"] += us / n
        rows[g]["fast_us"] += min(durations[op]) * len(durations[op]) / n
        rows[g]["ops"] += counts[op] / n
    for op, o in ops.items():
        if op in counts:
            rows[o["group"]]["flops"] += o["flops"]

    print(
        f"The study's step: `{' '.join([*STUDY, *args.overrides])}`, {run.model_cfg.family} d_model "
        f"{run.model_cfg.d_model}, {run.model_cfg.encoder_layers}+{run.model_cfg.decoder_layers} layers, "
        f"batch {bs}, {run.model_cfg.dtype}; its core jitted alone on {jax.devices()[0]}, one fixed batch.\n"
    )
    print(
        f"Step: median {1e3 * statistics.median(plain):.1f} ms unprofiled ({args.steps} steps after {args.warmup} "
        f"warm-up), mean {step_us / 1e3:.1f} ms profiled ({n} steps, dispatch to dispatch). Load average at the "
        f"profile: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.\n"
    )
    if os.getloadavg()[0] > os.cpu_count():
        print(
            f"The machine was loaded (load average {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores): every op "
            "and gap here is longer than on an idle machine, the long ones the most; the shares are of this run's "
            "step, and on a quiet machine they are to be measured again.\n"
        )
    print(
        f"FLOPs per step: {flops_total / 1e9:.2f} GFLOP counted from the HLO's shapes; the executable's "
        f"cost_analysis() {cost.get('flops', float('nan')) / 1e9:.2f} GFLOP "
        f"(+ {cost.get('transcendentals', 0) / 1e9:.3f} G transcendentals); model/flops.py (matmuls, 3x forward) "
        f"{model_flops / 1e9:.2f} GFLOP. {len(ops)} instructions in the entry computation, "
        f"{sum(counts.values()) / n:.0f} thunks executed per step.\n"
    )
    print(
        "| group | ops per step | ms per step | share of step | fastest op time (ms) | GFLOP per step | "
        "share of FLOPs | GFLOP/s (fastest op time) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for g, r in sorted(rows.items(), key=lambda kv: -kv[1]["us"]):
        if not r["ops"]:
            continue
        rate = r["flops"] / (r["fast_us"] * 1e-6) / 1e9 if r["fast_us"] else float("nan")
        print(
            f"| {g} | {r['ops']:.0f} | {r['us'] / 1e3:.2f} | {100 * r['us'] / step_us:.1f} % | "
            f"{r['fast_us'] / 1e3:.2f} | {r['flops'] / 1e9:.3f} | {100 * r['flops'] / flops_total:.1f} % | "
            f"{rate:.1f} |"
        )
    for label, us in (
        ("host: dispatch to the first op", lead / n),
        ("host: the executor's gaps between ops", gaps / n),
        ("host: last op to the next dispatch (wait, Python loop)", tail / n),
    ):
        print(f"| {label} | | {us / 1e3:.2f} | {100 * us / step_us:.1f} % | | 0 | 0 % | |")
    device = sum(r["us"] for r in rows.values())
    print(
        f"| **the step** | {sum(counts.values()) / n:.0f} | {step_us / 1e3:.2f} | 100 % | "
        f"{sum(r['fast_us'] for r in rows.values()) / 1e3:.2f} | {flops_total / 1e9:.3f} | 100 % | "
        f"{flops_total / (step_us * 1e-6) / 1e9:.1f} (over the step) |"
    )
    dm = statistics.median(data)
    print(
        f"| data, timed apart (next batch + device_put; not in the core) | | {1e3 * dm:.2f} | "
        f"{100 * dm / (step_us * 1e-6):.1f} % of the step | | 0 | | |"
    )
    moved = [op for op in given if op in ops and "transpose" in ops[op]["opcodes"]]
    moved_us = sum(given[op] for op in moved) / n
    print(
        f"\nOf these, the ops with a transpose inside (a layout change fused into them, in any group): "
        f"{sum(counts[op] for op in moved) / n:.0f} per step, {moved_us / 1e3:.2f} ms, {100 * moved_us / step_us:.1f} % "
        f"of the step, {sum(ops[op]['flops'] for op in moved) / flops_total * 100:.1f} % of the FLOPs."
    )
    print(
        f"\nOps busy {device / 1e3:.2f} ms of the {step_us / 1e3:.2f} ms step ({100 * device / step_us:.0f} %). "
        "`ms per step`: the wall time given to the group's ops, mean over the profiled steps (ops running at once "
        "share it). `fastest op time`: each op's own duration, its fastest over the steps, summed over the group "
        "(what the op costs when no other process takes its core mid-op, on a shared machine); GFLOP/s is the "
        "group's FLOPs over it."
    )
    if unknown:
        print(f"\nThunks not matched to an entry instruction: {', '.join(sorted(unknown)[:10])}.")

    # Dense matmuls by shape.
    by_shape: dict[str, dict] = collections.defaultdict(lambda: {"n": 0, "us": 0.0, "flops": 0})
    for op, o in ops.items():
        if op not in durations or not o["dots"]:
            continue
        lhs, rhs, out, _ = max(o["dots"], key=lambda d: d[3])
        key = f"{'x'.join(map(str, lhs))} . {'x'.join(map(str, rhs))} -> {'x'.join(map(str, out))}"
        impl = "YNNPACK" if op.startswith("ynn_fusion") else ("XLA dot" if o["opcode"] == "dot" else "XLA fusion")
        s = by_shape[(f"{o['group'].split(' (')[0]}, {impl}", key)]
        s["n"] += 1
        s["us"] += min(durations[op])
        s["flops"] += o["flops"]
        s["mkn"] = (out[0], _ // (2 * math.prod(out)), math.prod(out[1:])) if len(out) >= 2 else None
    dense = [s for (kind, _), s in by_shape.items() if kind.startswith("dense") and s["mkn"]]
    common = max(dense, key=lambda s: s["us"])["mkn"] if dense else None
    own = (
        f", ({common[0]}x{common[1]}) . ({common[1]}x{common[2]}) alone {matmul_rate(*common):.0f} GFLOP/s"
        if common
        else ""
    )
    print("\n### The matmuls by shape (the largest dot of each op; fastest op time)\n")
    print(
        f"This machine's float32 matmul, jitted alone in this run, fastest of 30 (20 for the second): 1024x1024x1024 {peak:.0f} GFLOP/s{own}.\n"
    )
    print("| kind, thunk | lhs . rhs -> out | ops | ms per step | GFLOP per step | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for (kind, key), s in sorted(by_shape.items(), key=lambda kv: -kv[1]["us"])[:14]:
        print(
            f"| {kind} | {key} | {s['n']} | {s['us'] / 1e3:.2f} | {s['flops'] / 1e9:.3f} | "
            f"{s['flops'] / (s['us'] * 1e-6) / 1e9:.1f} |"
        )

    # The slowest single ops.
    print("\n### The 12 slowest ops (fastest over the steps)\n")
    print("| op | group | shape | ms | GFLOP | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for op in sorted(durations, key=lambda o: -min(durations[o]))[:12]:
        o = ops.get(op, {"group": "?", "shape": "?", "flops": 0})
        us = min(durations[op])
        print(
            f"| {op} | {o['group']} | {o['shape'].split('{')[0]} | {us / 1e3:.3f} | {o['flops'] / 1e9:.4f} | "
            f"{o['flops'] / (us * 1e-6) / 1e9:.1f} |"
        )
    print()
    conclude(
        rows, step_us, flops_total, peak, (lead, gaps, tail), n, sum(counts.values()) / n, moved_us, dm, run, dense
    )


def conclude(rows, step_us, flops_total, peak, host, n, ops_per_step, moved_us, data_s, run, dense) -> None:
    """What the numbers above say, in sentences computed from them (so a rerun rewrites them)."""
    mm = [rows[GROUPS[0]], rows[GROUPS[1]]]
    mm_us, mm_fast = sum(r["us"] for r in mm), sum(r["fast_us"] for r in mm)
    mm_flops = sum(r["flops"] for r in mm)
    rest = [r for g, r in rows.items() if g not in GROUPS[:2]]
    rest_us, rest_flops = sum(r["us"] for r in rest), sum(r["flops"] for r in rest)
    host_us = sum(host) / n
    rate = mm_flops / (mm_fast * 1e-6) / 1e9
    pct = lambda us: 100 * us / step_us  # noqa: E731
    print("### What holds the step back (computed from the tables above)\n")
    by_k = {"thin": [0, 0.0], "wide": [0, 0.0]}  # dense matmuls contracting over a width vs over the rows
    for d in dense:
        side = by_k["wide" if d["mkn"][1] >= 4 * run.model_cfg.d_model else "thin"]
        side[0], side[1] = side[0] + d["flops"], side[1] + d["us"]
    thin, wide = (f / (us * 1e-6) / 1e9 if us else float("nan") for f, us in by_k.values())
    best = max(peak, wide if wide == wide else 0.0)
    print(
        f"- The matmuls are {100 * mm_flops / flops_total:.0f} % of the FLOPs and {pct(mm_us):.0f} % of the step; "
        f"at their fastest they run at {rate:.0f} GFLOP/s. Those that contract over a width (d_model "
        f"{run.model_cfg.d_model} or ffn_dim {run.model_cfg.ffn_dim}: the forward and the input gradients, "
        f"{100 * by_k['thin'][0] / max(mm_flops, 1):.0f} % of the matmul FLOPs) reach {thin:.0f} GFLOP/s; the weight "
        f"gradients, which contract over the batch's {run.cfg.trainer.batch_size} x {run.model_cfg.text_len} or "
        f"{run.model_cfg.image_len} rows, {wide:.0f} GFLOP/s, in the same run; attention's are per head of "
        f"{run.model_cfg.d_model // run.model_cfg.heads} over {run.model_cfg.text_len} or "
        f"{run.model_cfg.image_len} positions. The 1024x1024x1024 matmul alone reached {peak:.0f} GFLOP/s"
        + (
            f": the step's matmuls run at {100 * rate / peak:.0f} % of it."
            if rate < peak
            else f", less than the step's: at load {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores a "
            "long op is rarely left alone, so this run cannot give the machine's peak (the step's short matmuls "
            "against its long weight-gradient ones is the comparison it can make)."
        )
    )
    print(
        f"- Everything else on the device (norms, the GeLU/GLU, attention's softmax and masks, copies and "
        f"transposes, the optimizer, the loss, the embeddings) is {100 * rest_flops / flops_total:.1f} % of the "
        f"FLOPs and {pct(rest_us):.0f} % of the step: memory- and launch-bound ops, each a few microseconds to "
        f"milliseconds for kilo- to mega-FLOPs. The ops with a layout transpose fused into them (mostly the "
        f"backward's, feeding the weight gradients) are {pct(moved_us):.0f} % of it on their own."
    )
    print(
        f"- The host and the runtime, no op running: {pct(host_us):.0f} % of the step ({pct(host[1] / n):.0f} % "
        f"between ops, {host[1] / n / max(ops_per_step, 1):.0f} µs per op over {ops_per_step:.0f} ops a step; "
        f"{pct(host[0] / n):.0f} % from the dispatch to the first op; {pct(host[2] / n):.0f} % after the last). "
        f"On a loaded machine much of the gap between ops is waiting to be scheduled again."
    )
    print(
        f"- The data a run's loop reads per step is {1e3 * data_s:.2f} ms, {100 * data_s / (step_us * 1e-6):.1f} % "
        f"of the step: not where the step goes."
    )
    print("\nThe levers this points to, in the order of the time they could give back:\n")
    levers = sorted(
        [
            (
                max(0.0, mm_us * (1 - rate / best)),
                "bigger matmuls: more rows per matmul at the same width (a larger batch, or several seeds as members of "
                "one program, benchmarks/members.py), which moves the matmuls toward the rate of the best ones in this run",
            ),
            (
                rest_us,
                "fewer and cheaper elementwise ops: fusing the norms', GeLU/GLU's and softmax's forward and backward "
                "into fewer passes, and avoiding the transposed layouts XLA fuses into the backward's elementwise ops",
            ),
            (
                host_us,
                "fewer ops per step (each costs the executor a dispatch whatever its size): one program doing more per "
                "op, as members do, rather than a faster host",
            ),
        ],
        key=lambda lv: -lv[0],
    )
    for i, (us, text) in enumerate(levers, 1):
        print(f"{i}. {text} (up to {us / 1e3:.0f} ms of the {step_us / 1e3:.0f} ms step, {pct(us):.0f} %)")


if __name__ == "__main__":
    main()
