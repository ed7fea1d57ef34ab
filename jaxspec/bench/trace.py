"""Profiler traces of engine steps: the GPU kernel (or XLA:CPU thunk) events of a traced run,
and their time by engine scope.

Kernel -> scope: each GPU kernel event carries XLA's launch annotation as stats. A stat holding
the op_name path (tf_op / op_name / name / long_name) gives the scope directly (its first path
component that is a scope name); else the kernel's hlo_op stat is looked up in the compiled
step's HLO text (metadata op_name of that instruction, or of the instructions it calls); else the
kernel name itself is tried as an HLO instruction name. Kernels still unmapped count as "other".
Kernels that XLA launches from a command buffer (a CUDA graph) carry the graph's name as hlo_op,
not their own: they count under "command_buffer".
"""

import collections
import functools
import glob
import os
import re
import tempfile

SCOPES = ("draft", "estimator", "plan", "verify", "accept", "commit", "draft_context")
PATH_STATS = ("tf_op", "op_name", "name", "long_name")  # stats that may hold the op_name path


def _scope_of_path(path):
    """The engine scope of an op_name path ("jit(_step)/verify/..."): its first component that is a scope."""
    if not path or not isinstance(path, str):
        return None
    for part in re.split(r"[/:]", path):
        if part in SCOPES:
            return part
    return None


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(")
_INST = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALL_LISTS = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_OPERAND = re.compile(r"%([\w.\-]+)")


def hlo_op_names(text):
    """{instruction name (and its normalised kernel form): the op_name of its metadata} of an HLO text."""
    out = {}
    for line in text.splitlines():
        m, op = _INST.match(line), _OPNAME.search(line)
        if m and op:
            out[m.group(1)] = out[_norm_name(m.group(1))] = op.group(1)
    return out


def hlo_scopes(text):
    """{instruction name: (scope or None, how)} of a compiled HLO module's text. how: "metadata" (the scope
    of the instruction's metadata op_name), "called" (none of its own: the most common scope among the
    instructions of the computations it calls: fusions, while bodies, recursively) or "neighbour" (neither:
    the most common scope of its operands, else of its users, propagated up to 3 times; e.g. the copies XLA
    adds for donated state, which carry no metadata); (None, None) when nothing gives one."""
    own, calls, operands, comp_insts = {}, {}, {}, collections.defaultdict(list)
    comp = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _HEADER.match(line)
            comp = m.group(1) if m else None
            continue
        m = _INST.match(line)
        if not m:
            continue
        name = m.group(1)
        op = _OPNAME.search(line)
        own[name] = _scope_of_path(op.group(1)) if op else None
        called = _CALLS.findall(line)
        for lst in _CALL_LISTS.findall(line):
            called += [c.strip().lstrip("%") for c in lst.split(",") if c.strip()]
        calls[name] = called
        rhs = line[m.end() :].split(", metadata=")[0]
        operands[name] = [o for o in _OPERAND.findall(rhs) if o not in called and o != name]
        if comp is not None:
            comp_insts[comp].append(name)
    memo = {}

    def comp_scope(c, depth=0):
        if c in memo:
            return memo[c]
        memo[c] = None
        count = collections.Counter()
        for inst in comp_insts.get(c, ()):
            s = own.get(inst) or (inst_scope(inst, depth + 1) if depth < 8 else None)
            if s:
                count[s] += 1
        memo[c] = count.most_common(1)[0][0] if count else None
        return memo[c]

    def inst_scope(name, depth=0):
        if own.get(name):
            return own[name]
        count = collections.Counter(s for c in calls.get(name, ()) if (s := comp_scope(c, depth)))
        return count.most_common(1)[0][0] if count else None

    out = {}
    for name in own:
        scope = inst_scope(name)
        out[name] = (scope, ("metadata" if own[name] else "called") if scope else None)
    users = collections.defaultdict(list)
    for name, ops in operands.items():
        for o in ops:
            users[o].append(name)
    for _ in range(3):
        changed = False
        for name, (scope, _how) in list(out.items()):
            if scope:
                continue
            for near in (operands.get(name, ()), users.get(name, ())):
                count = collections.Counter(out[n][0] for n in near if n in out and out[n][0])
                if count:
                    out[name] = (count.most_common(1)[0][0], "neighbour")
                    changed = True
                    break
        if not changed:
            break
    return out


def _norm_name(name):
    return re.sub(r"[.\-]", "_", name)


def traced(run):
    """Run `run()` under the jax profiler (CUPTI on the GPU). Returns (gpu, cpu): gpu a list of
    (start_ns, dur_ns, kernel name, stats dict, line name) of the GPU planes' stream lines (memcpy /
    memset included; the caller separates them), cpu the XLA:CPU thunk events (host events with an
    hlo_op stat). The caller synchronises inside `run` (what runs after it is not in the trace)."""
    import jax
    from jax.profiler import ProfileData

    gpu, cpu = [], []
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        for plane in ProfileData.from_file(paths[0]).planes if paths else ():
            on_gpu = plane.name.startswith("/device:GPU")
            for line in plane.lines:
                if on_gpu and "stream" not in line.name.lower():
                    continue  # "XLA Ops" / "XLA Modules" lines are derived
                for ev in line.events:
                    stats = {}
                    for k, v in ev.stats:
                        stats.setdefault(k, v if isinstance(v, (int, float, str)) else str(v))
                    if on_gpu:
                        gpu.append((ev.start_ns, ev.duration_ns, ev.name, stats, line.name))
                    elif plane.name.startswith("/host") and "hlo_op" in stats:
                        cpu.append((ev.start_ns, ev.duration_ns, ev.name, stats, line.name))
    return gpu, cpu


def trace_events(fn, calls):
    """`traced` of `calls` back-to-back calls of fn, synchronised once, after two untimed ones."""
    import jax

    jax.block_until_ready(fn())
    jax.block_until_ready(fn())

    def run():
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)

    return traced(run)


def busy_ns(events) -> int:
    """Time (ns) during which at least one of the events runs: the union of their [start, start +
    duration) intervals. Kernels of one step can overlap (a CUDA graph runs independent nodes
    concurrently), so the summed durations can exceed the time the GPU was busy."""
    total, end = 0, None
    for start, dur, *_ in sorted(events, key=lambda e: e[0]):
        stop = start + dur
        if end is None or start >= end:
            total += dur
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def is_copy(event) -> bool:
    """A memcpy / memset event (not a kernel)."""
    return "memcpy" in event[2].lower() or "memset" in event[2].lower()


def map_events(events, calls, hlo_text_fn):
    """Per-scope time of traced kernel events. hlo_text_fn() gives the compiled step's HLO text; called
    only when some event has no op_name path stat. Returns a dict: busy_ms (summed durations / calls),
    span_ms, by_scope (ms a step), by_source (how each kernel was mapped), by_kernel (top 15 names by time:
    ms a step, launches a step, scopes), kernels (every kernel name by time: ms and launches a step and
    the op_name path of its first launch, from the event's stats or the HLO's metadata: which jax op it
    runs), unmapped (first 30), stats (stat names seen), sample (the first 3
    events' stats), memcpy_ms; None when there is no event."""
    hlo_text_fn = functools.cache(hlo_text_fn)  # compiling the step for its text: at most once
    kernels, copies = [], []
    for e in events:
        (copies if is_copy(e) else kernels).append(e)
    if not kernels:
        return None
    stat_names = sorted({k for e in kernels for k in e[3]})
    scopes_by_op = None
    hlo_error = None
    by_scope, by_source, unmapped, unmapped_ns = collections.Counter(), collections.Counter(), [], 0
    kern_ms, kern_n, kern_scopes = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    kern_path = {}
    for _start, dur, name, stats, _ in kernels:
        scope, source = None, None
        if name not in kern_path:
            # an op_name path has a "/"; XLA:GPU sets tf_op to the bare "XlaModule:" on every kernel
            kern_path[name] = next((stats[k] for k in PATH_STATS if "/" in str(stats.get(k, ""))), None)
        if str(stats.get("hlo_op", "")).startswith("command_buffer"):
            # launched from a CUDA graph: the annotation names the graph, not the kernel's own op
            scope, source = "command_buffer", "command_buffer"
        for key in PATH_STATS if scope is None else ():
            if isinstance(stats.get(key), str) and (scope := _scope_of_path(stats[key])):
                source = "stat:" + key
                break
        if scope is None and scopes_by_op is None and hlo_error is None:
            try:
                text = hlo_text_fn()
                scopes_by_op = hlo_scopes(text)
                scopes_by_op.update({_norm_name(k): v for k, v in list(scopes_by_op.items())})
            except Exception as e:  # noqa: BLE001 - recorded, the breakdown goes on
                hlo_error = repr(e)[:300]
        if scope is None and scopes_by_op:
            ops = [o for o in re.split(r"[;,\s]+", str(stats.get("hlo_op", ""))) if o]
            for key, src in [(op, "hlo_op") for op in reversed(ops)] + [(name, "kernel_name")]:  # innermost first
                scope, how = scopes_by_op.get(key) or scopes_by_op.get(_norm_name(key)) or (None, None)
                if scope:
                    source = f"{src}:{how}"
                    break
        if scope is None:
            scope, source = "other", "unmapped"
            if len(unmapped) < 30 and name[:160] not in {u["kernel"] for u in unmapped}:
                unmapped.append(
                    {
                        "kernel": name[:160],
                        "hlo_op": str(stats.get("hlo_op", ""))[:120],
                        "hlo_module": str(stats.get("hlo_module", ""))[:80],
                    }
                )
        by_scope[scope] += dur
        by_source[source] += 1
        unmapped_ns += dur if source == "unmapped" else 0
        kern_ms[name] += dur
        kern_n[name] += 1
        kern_scopes[name].add(scope)
    start = min(e[0] for e in kernels)
    end = max(e[0] + e[1] for e in kernels)
    per = lambda ns: ns / 1e6 / calls
    top = [
        {"kernel": k[:200], "ms": per(v), "launches": kern_n[k] / calls, "scopes": sorted(kern_scopes[k])}
        for k, v in kern_ms.most_common(15)
    ]
    if hlo_error is None and any(path is None for path in kern_path.values()):
        try:
            op_names = hlo_op_names(hlo_text_fn())
        except Exception:  # noqa: BLE001 - the list keeps the kernel names
            op_names = {}
        for name, stats in ((e[2], e[3]) for e in kernels):
            if kern_path.get(name) is None:
                ops = [o for o in re.split(r"[;,\s]+", str(stats.get("hlo_op", ""))) if o] + [name]
                kern_path[name] = next((op_names[o] for o in ops if o in op_names), None)
    every = [
        {"kernel": k[:200], "ms": per(v), "launches": kern_n[k] / calls, "path": (kern_path.get(k) or "")[:200]}
        for k, v in kern_ms.most_common()
    ]
    return {
        "busy_ms": per(sum(e[1] for e in kernels)),
        "span_ms": per(end - start),
        "kernels_per_step": len(kernels) / calls,
        "by_scope": {s: per(by_scope[s]) for s in SCOPES + ("command_buffer", "other") if by_scope[s]},
        "by_source": dict(by_source),
        "by_kernel": top,
        "kernels": every,
        "unmapped": unmapped,
        "unmapped_ms": per(unmapped_ns),
        "stats": stat_names,
        "sample": [{k: str(v)[:300] for k, v in e[3].items()} for e in kernels[:3]],
        "memcpy_ms": per(sum(e[1] for e in copies)),
        "hlo_error": hlo_error,
        "modules": sorted({str(e[3].get("hlo_module", "")) for e in kernels})[:10],
    }
