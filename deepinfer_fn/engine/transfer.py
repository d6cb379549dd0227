"""Prefill / decode separation: a request's engine state as a host record, moved between engines.

`Engine.prefill(requests)` runs each request's prefill, samples its first token and returns a
`RequestState`; `Engine.generate` / `stream` of another engine (another process or mesh, same
model config, page_size, window_slots, dtype and speculative method / γ) take it as an item
and continue decoding: the tokens equal one engine doing both.

A `RequestState` holds host numpy arrays and plain Python values only (picklable): the prompt,
the tokens sampled so far (the last one is the next decode input, `last_token`), their
logprobs, `position` (positions already in the state = prompt + generated - 1), the slot's
per-slot rings of every layer (`PagedState.slots` at the slot, slot axis removed; V4.1: then
the slot's token ring), the
contents of the request's pages in every pool in block order (page axis first:
[n_pages, (R,) rows per page, d]), for speculative engines the slot's counters (committed
length, token budget, step counter) and drafter state leaves, the `Request` itself (sampling
parameters, stop tokens, id, constraint, max_new_tokens) and the exporting engine's
`fingerprint`.

Device side: `gather_request` (one slot + its page ids -> arrays) and `scatter_request` (the
arrays -> a slot + freshly allocated pages of another `PagedState`, donated). Page-id vectors
are padded to a few bucket sizes (gather: the null page, trimmed on the host; scatter: an
out-of-range id, dropped), so the two programs compile once per bucket.

The importing engine's output of a request holds every generated token (the first one,
sampled by the prefill engine, included). Imported pages are private copies (the importing
engine's prefix cache is not consulted; their full blocks join that cache when the request
ends, as any request's do). The counters of a speculative state are the host's exact values
(the prefill engine ran the request with a budget of one token). The weights themselves are
not fingerprinted: both engines must serve the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.engine.pages import NULL_PAGE
from deepinfer_fn.engine.paged_state import PagedState
from deepinfer_fn.engine.request import Request

SPEC_COUNTERS = ("length", "left", "step")


@dataclasses.dataclass(eq=False)
class RequestState:
    """One request's state after prefill (module docstring). `budget`: tokens it may still
    emit; `nbytes`: the bytes of every array it holds (what moves between engines)."""

    request: Request
    prompt: np.ndarray              # int32 [n_prompt]
    generated: np.ndarray           # int32 [g >= 1]; generated[-1] is the next decode input
    logprobs: np.ndarray            # f32 [g]
    position: int                   # n_prompt + g - 1 positions are in the state
    rings: tuple                    # PagedState.slots leaves at the slot (slot axis removed),
    #                                 then (V4.1) the slot's token ring int32 [R_t]
    pages: tuple                    # PagedState.pools leaves at the pages: [n_pages, (R,) rpp, d]
    spec: dict                      # {} or {"length", "left", "step"} (ints)
    drafter: tuple                  # PagedState.spec["drafter"] leaves at the slot, or ()
    fingerprint: dict

    @property
    def last_token(self) -> int:
        return int(self.generated[-1])

    @property
    def num_pages(self) -> int:
        return int(self.pages[0].shape[0]) if self.pages else 0

    @property
    def spec_steps(self) -> int:
        """Verify steps already applied (speculative engines; else 0)."""
        return int(self.spec.get("step", 0))

    @property
    def budget(self) -> int:
        return int(self.request.max_new_tokens) - len(self.generated)

    def arrays(self) -> list[np.ndarray]:
        return [self.prompt, self.generated, self.logprobs, *self.rings, *self.pages,
                *self.drafter]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())

    def to_request(self) -> "ImportedRequest":
        """The `Request` an importing engine admits (carries this state)."""
        fields = {f.name: getattr(self.request, f.name) for f in dataclasses.fields(Request)}
        fields["tokens"] = self.prompt.tolist()
        return ImportedRequest(**fields, state=self)


@dataclasses.dataclass
class ImportedRequest(Request):
    """A `Request` whose prefill ran in another engine: admitted from `state`."""

    state: RequestState | None = None


@dataclasses.dataclass
class PrefillRequest(Request):
    """A `Request` run by `Engine.prefill` (max_new_tokens = 1: the first token); `full` is the
    caller's request, exported with its own budget."""

    full: Request | None = None

    @classmethod
    def of(cls, req: Request) -> "PrefillRequest":
        fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(Request)}
        fields["max_new_tokens"] = 1
        return cls(**fields, full=req)


# --- compatibility ---------------------------------------------------------------------------


def fingerprint(cfg, *, page_size: int, window_slots: int, dtype, speculative: str | None,
                gamma: int, drafter=None) -> dict:
    """What an importing engine must share with the exporting one (plain values)."""
    dcfg = getattr(drafter, "config", None)
    return {"model": tuple((f.name, repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)),
            "page_size": int(page_size), "window_slots": int(window_slots),
            "dtype": str(jnp.dtype(dtype)), "speculative": speculative, "gamma": int(gamma),
            "drafter": None if dcfg is None else repr(dcfg)}


def fingerprint_mismatch(have: dict, want: dict) -> str | None:
    """A message naming every difference between a state's fingerprint and an engine's."""
    if not isinstance(have, dict) or set(have) != set(want):
        return f"fingerprint {have!r} is not an engine fingerprint"
    msgs = []
    if have["model"] != want["model"]:
        a, b = dict(have["model"]), dict(want["model"])
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        msgs.append("model config differs in " + ", ".join(
            f"{k} (state {a.get(k, '-')}, engine {b.get(k, '-')})" for k in diff[:6])
            + (f" and {len(diff) - 6} more" if len(diff) > 6 else ""))
    for k in ("page_size", "window_slots", "dtype", "speculative", "gamma", "drafter"):
        if have[k] != want[k]:
            name = "γ" if k == "gamma" else "speculative method" if k == "speculative" else k
            msgs.append(f"{name} (state {have[k]!r}, engine {want[k]!r})")
    return "; ".join(msgs) or None


def state_error(rs: RequestState) -> str | None:
    """A message when the record is inconsistent in itself (else None)."""
    if not isinstance(rs, RequestState):
        return f"expected a RequestState, got {type(rs).__name__}"
    page_size = rs.fingerprint.get("page_size") if isinstance(rs.fingerprint, dict) else None
    if not isinstance(page_size, int) or page_size < 1:
        return f"fingerprint {rs.fingerprint!r} has no page_size"
    n_prompt, g = len(rs.prompt), len(rs.generated)
    if g < 1 or len(rs.logprobs) != g:
        return (f"needs >= 1 generated token with its logprob, got {g} tokens, "
                f"{len(rs.logprobs)} logprobs")
    if rs.position != n_prompt + g - 1:
        return f"position {rs.position} != prompt ({n_prompt}) + generated ({g}) - 1"
    if rs.budget < 1:
        return (f"no tokens left to generate (max_new_tokens {rs.request.max_new_tokens}, "
                f"{g} generated)")
    want_pages = -(-rs.position // page_size)
    if rs.pages and rs.num_pages != want_pages:
        return (f"{rs.num_pages} pages for {rs.position} positions (page_size {page_size}: "
                f"{want_pages})")
    return None


def shape_mismatch(rs: RequestState, want: tuple) -> str | None:
    """Compares the record's arrays with an engine's expected (rings, pages, drafter) leaves,
    each [(path, ShapeDtypeStruct)] (`expected_shapes`)."""
    for kind, have, exp in zip(("ring", "page", "drafter"), (rs.rings, rs.pages, rs.drafter),
                               want):
        if len(have) != len(exp):
            return f"{len(have)} {kind} arrays, the engine has {len(exp)}"
        for i, (a, (path, e)) in enumerate(zip(have, exp)):
            if tuple(a.shape) != tuple(e.shape) or np.dtype(a.dtype) != np.dtype(e.dtype):
                return (f"{kind} array {i} ({path}): {a.dtype}{list(a.shape)}, the engine "
                        f"expects {np.dtype(e.dtype)}{list(e.shape)}")
    return None


# --- device functions ------------------------------------------------------------------------


def _slot_leaf(scanned, v, slot):
    return v[:, slot] if scanned else v[slot]


@jax.jit
def gather_request(state: PagedState, slot, page_ids):
    """(rings, pages, spec, last_token) of one slot: rings = (`state.slots` at slot int32 []
    (slot axis removed), the V4.1 token ring at the slot or None), pages = `state.pools` at page_ids int32 [n] with the page axis first
    ([n, (R,) rpp, d]), spec = `state.spec` at the slot ({} for plain engines), last_token []."""
    rings = (state.slots.map_blocks(lambda scanned, layer: {
        k: _slot_leaf(scanned, v, slot) for k, v in layer.items()}),
        None if state.token_ring is None else state.token_ring[slot])
    pages = state.pools.map_blocks(lambda scanned, pool: {
        k: jnp.moveaxis(v[:, page_ids], 1, 0) if scanned else v[page_ids]
        for k, v in pool.items()})
    spec = jax.tree.map(lambda x: x[slot], state.spec)
    return rings, pages, spec, state.last_token[slot]


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_request(state: PagedState, slot, page_ids, rings, pages, spec,
                    last_token) -> PagedState:
    """Writes `gather_request`'s arrays into slot int32 [] and pages page_ids int32 [n] (ids
    >= num_pages are dropped: padding) of `state` (donated)."""
    def put_rings(scanned, layer, new):
        return {k: (v.at[:, slot] if scanned else v.at[slot]).set(new[k]) for k, v in layer.items()}

    def put_pages(scanned, pool, new):
        return {k: (v.at[:, page_ids].set(jnp.moveaxis(new[k], 0, 1), mode="drop") if scanned
                    else v.at[page_ids].set(new[k], mode="drop")) for k, v in pool.items()}

    new_spec = jax.tree.map(lambda x, v: x.at[slot].set(v.astype(x.dtype)), state.spec, spec)
    slot_rings, token_ring = rings
    extra = {}
    if state.token_ring is not None:
        extra["token_ring"] = state.token_ring.at[slot].set(token_ring)
    return dataclasses.replace(
        state, slots=state.slots.map_blocks(put_rings, slot_rings), **extra,
        pools=state.pools.map_blocks(put_pages, pages), spec=new_spec,
        last_token=state.last_token.at[slot].set(last_token))


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} pages exceed the largest bucket {buckets[-1]}")


def _split_spec(spec: dict) -> tuple[dict, tuple]:
    counters = {k: spec[k] for k in SPEC_COUNTERS if k in spec}
    return counters, tuple(jax.tree.leaves(spec.get("drafter", {})))


def _named(tree) -> tuple:
    return tuple((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(tree))


def expected_shapes(state: PagedState, n_pages: int, buckets: tuple[int, ...]) -> tuple:
    """The (rings, pages, drafter) leaves [(path, ShapeDtypeStruct)] a record of n_pages pages
    must have to be imported into `state` (abstract evaluation, nothing runs)."""
    b = _bucket(max(n_pages, 1), buckets)
    rings, pages, spec, _ = jax.eval_shape(gather_request, state, jnp.int32(0),
                                           jnp.zeros((b,), jnp.int32))
    pages = tuple((k, jax.ShapeDtypeStruct((n_pages,) + p.shape[1:], p.dtype))
                  for k, p in _named(pages))
    return _named(rings), pages, _named(spec.get("drafter", {}))


def start_export(state: PagedState, slot: int, pages: list[int], buckets: tuple[int, ...]):
    """Dispatches the gather of a slot and its pages (asynchronous; device -> host copies
    started). Returns the pending arrays for `finish_export`."""
    n = len(pages)
    ids = np.full((_bucket(max(n, 1), buckets),), NULL_PAGE, np.int32)
    ids[:n] = pages
    out = gather_request(state, jnp.int32(slot), ids)
    for leaf in jax.tree.leaves(out):
        leaf.copy_to_host_async()
    return out, n


def finish_export(pending) -> tuple:
    """(rings, pages, spec counters, drafter leaves, last_token) as host arrays / ints."""
    (rings, pages, spec, last), n = pending
    counters, drafter = _split_spec(spec)
    return (tuple(np.asarray(x) for x in jax.tree.leaves(rings)),
            tuple(np.asarray(x)[:n] for x in jax.tree.leaves(pages)),
            {k: int(v) for k, v in counters.items()},
            tuple(np.asarray(x) for x in drafter), int(last))


def import_state(state: PagedState, slot: int, pages: list[int], rs: RequestState,
                 buckets: tuple[int, ...]) -> PagedState:
    """Scatters `rs` into slot and the (freshly allocated) pages of `state` (donated). The
    record must be compatible (`fingerprint_mismatch`, `shape_mismatch`, `state_error`)."""
    n = len(pages)
    assert not rs.pages or n == rs.num_pages, (n, rs.num_pages)
    b = _bucket(max(n, 1), buckets)
    num_pages = jax.tree.leaves(state.pools)[0].shape[-3] if jax.tree.leaves(state.pools) else 1
    ids = np.full((b,), num_pages, np.int32)
    ids[:n] = pages
    rings_t = jax.tree.structure((state.slots, state.token_ring))
    pools_t = jax.tree.structure(state.pools)
    padded = [np.concatenate([p, np.zeros((b - n,) + p.shape[1:], p.dtype)]) if b > n else p
              for p in rs.pages]
    spec = {}
    if state.spec:
        spec = {k: np.int32(rs.spec[k]) for k in SPEC_COUNTERS}
        spec["drafter"] = jax.tree.unflatten(jax.tree.structure(state.spec["drafter"]),
                                             list(rs.drafter))
    return scatter_request(state, jnp.int32(slot), ids, jax.tree.unflatten(rings_t, list(rs.rings)),
                           jax.tree.unflatten(pools_t, padded), spec, np.int32(rs.last_token))
