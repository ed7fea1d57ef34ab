"""A closed-loop client: keeps c requests in flight on an Engine through `submit` / `step`."""

import collections
import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a workload: prompt ids, output length, PRNG seed."""

    prompt: list
    max_new_tokens: int
    seed: int


@dataclasses.dataclass
class Record:
    """What the client saw of one request: clock times of its submission, of the turn that
    returned its first token and of the turn that returned its finish; its GenerationResult."""

    submitted: float
    first: float | None = None
    finished: float | None = None
    result: object = None


def closed_loop(engine, requests, concurrency, *, sampling, clock=time.perf_counter, on_finish=None) -> dict:
    """Run `requests` (Request) on an idle `engine`, keeping `concurrency` of them in flight: the
    first `concurrency` are submitted at once, then one more each time one finishes (the engine
    admits it at its next turn: continuous batching). sampling: `Engine.submit`'s temperature /
    top_k / top_p. on_finish(record) is called as each request finishes (a progress bar).

    Returns {"records": [Record] in request order, "wall_s": first submission to the last
    finish, "totals": the engine's step totals over the steps read in that time (steps, rows,
    verified, tier_tokens), "tier_counts": {tier tokens: steps}}; the engine is idle again. A
    refused request raises RuntimeError.
    """
    if engine.busy:
        raise RuntimeError("closed_loop: the engine is not idle")
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    totals, tiers = collections.Counter(engine.totals), collections.Counter(engine.tier_counts)
    pending = collections.deque(enumerate(requests))
    records, by_id, in_flight = [None] * len(requests), {}, 0
    start = clock()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            index, req = pending.popleft()
            records[index] = Record(submitted=clock())
            by_id[engine.submit(req.prompt, req.max_new_tokens, seed=req.seed, **sampling)] = records[index]
            in_flight += 1
        events = engine.step()
        now = clock()
        for event in events:
            record = by_id[event.request]
            if event.first:
                record.first = now
            if event.result is not None:
                if event.result.error is not None:
                    raise RuntimeError(f"closed_loop: a request was refused: {event.result.error}")
                record.finished, record.result = now, event.result
                in_flight -= 1
                if on_finish is not None:
                    on_finish(record)
    out = {
        "records": records,
        "wall_s": clock() - start,
        "totals": dict(collections.Counter(engine.totals) - totals),
        "tier_counts": dict(collections.Counter(engine.tier_counts) - tiers),
    }
    while engine.busy:  # the step in flight holds only finished requests' rows
        engine.step()
    return out
