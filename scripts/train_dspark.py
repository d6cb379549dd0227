"""Trains the DSpark drafter of the embedded default model on the model's own outputs.

    python scripts/train_dspark.py [--out deepinfer_fn/assets/default_model/dspark]

Steps (docs/MODEL.md §D1.6, adapted to a 12.5M-parameter target and a 2-core CPU):

1. prompts: random 48-token snippets of the stdlib sources the default model was trained on
   (scripts/train_default_model.py's corpus; training snippets from its training files,
   held-out ones from its validation files);
2. data: the default model continues every prompt with `generate` at temperature 1 (its own
   samples, as DeepSpec regenerates responses with the target); one cached forward over each
   whole sequence captures the drafter's target features (the taps of
   `forward_chunk(..., taps=...)`) and the target's final normed hidden state, from which the
   training step computes the target distribution p_t (temperature 1) with the frozen head;
3. training: anchors P in the generated region, blocks [y_P, NOISE x (γ-1)] at P..P+γ-1,
   context = the last W positions before P (KV injection), teacher-forced Markov head;
   loss per slot k with weight exp(-(k-1)/4): 0.1 CE(y_{P+k}) + 0.9 ||p_d - p_t||_1
   + 1.0 BCE(c_k, 1 - ||p_d - p_t||_1 / 2) (target detached); AdamW (no weight decay),
   warm-up, cosine decay, global-norm clip 1;
4. evaluation on held-out prompts with `generate(speculative="dspark")` (greedy and T = 1,
   fixed verify length γ) and the MTP drafter on the same prompts;
5. STS calibration (spec §1.5) of the confidence temperatures on the T = 1 held-out log
   (`speculative.schedule.sts_calibrate`; the raw log is kept as sts_log.npz);
6. saves `dspark.safetensors` (bf16) + `dspark_config.json` (config, STS temperatures, the
   training log) into --out.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]   # this tree's package; train_default_model
import deepinfer_fn as di  # noqa: E402
from deepinfer_fn.model import transformer  # noqa: E402
from deepinfer_fn.model.common import rms_norm  # noqa: E402
from deepinfer_fn.model.mhc import head_collapse  # noqa: E402
from deepinfer_fn.speculative import dspark  # noqa: E402
from deepinfer_fn.state import init_state  # noqa: E402


# ------------------------------------------------------------------------------ data
def corpus(split: str):
    """(root, relative paths) of the default model's training or validation files."""
    from train_default_model import corpus_files, is_validation, stdlib_root
    root = stdlib_root()
    files = [f for f in corpus_files(root) if is_validation(f) == (split == "val")]
    return root, files


def snippets(tok, split: str, n: int, length: int, seed: int) -> np.ndarray:
    """n prompts of `length` tokens starting at random line starts of random files."""
    from train_default_model import read_text
    root, files = corpus(split)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        text = read_text(root, files[rng.integers(len(files))])
        lines = text.splitlines(keepends=True)
        if len(lines) < 8:
            continue
        start = int(rng.integers(0, max(1, len(lines) - 4)))
        ids = tok.encode("".join(lines[start:start + 200])).ids
        if len(ids) >= length:
            out.append(ids[:length])
    return np.asarray(out, np.int32)


def self_samples(params, prompts: np.ndarray, new: int, seed: int, batch: int) -> np.ndarray:
    """prompt + `new` tokens sampled by the model itself at temperature 1: [N, P + new]."""
    seqs = []
    for i in range(0, len(prompts), batch):
        p = prompts[i:i + batch]
        out = di.generate(params, p, max_new_tokens=new, temperature=1.0,
                          seed=seed + i + np.arange(len(p)))
        seqs.append(np.concatenate([p, np.asarray(out.tokens)], 1))
    return np.concatenate(seqs).astype(np.int32)


def target_pass_fn(params, dcfg, capacity: int):
    @jax.jit
    def run(seqs):
        """seqs [B,T] -> (features [B,T,m,D], final normed hidden [B,T,D], logits [B,T,V]
        of the first row only (self-check))."""
        cfg = params.config
        B, T = seqs.shape
        state = init_state(cfg, B, capacity)
        _, _, streams, feats = transformer.forward_chunk(
            params, state, seqs, jnp.full((B,), T, jnp.int32), taps=dcfg.target_layer_ids,
            tap=dcfg.tap)
        hc = params["hc_head"]
        h = head_collapse(streams, hc["fn"], hc["base"], hc["scale"], hc_eps=cfg.hc_eps,
                          norm_eps=cfg.rms_norm_eps)
        hn = rms_norm(h, params["norm"], cfg.rms_norm_eps)
        ref = transformer.head_logits(hc, params["norm"], params["head"], streams[:1], cfg)
        return feats, hn, ref
    return run


def target_data(params, dcfg, seqs: np.ndarray, batch: int = 32):
    cfg = params.config
    run = target_pass_fn(params, dcfg, 1 << (seqs.shape[1] - 1).bit_length())
    feats, hn = [], []
    for i in range(0, len(seqs), batch):
        f, h, ref = run(jnp.asarray(seqs[i:i + batch]))
        if i == 0:   # self-check: p_t from the cached hidden == the model's logits
            lg = jnp.matmul(h[:1], params["head"], precision=jax.lax.Precision.HIGHEST)
            err = float(jnp.max(jnp.abs(lg - ref)))
            assert err < 1e-3 * float(jnp.max(jnp.abs(ref))), err
        feats.append(np.asarray(f))
        hn.append(np.asarray(h))
    return np.concatenate(feats), np.concatenate(hn)


# ------------------------------------------------------------------------------ loss
def block_loss(weights, temps, dcfg, params, seqs, feats, hn, anchors):
    """Mean DSpark loss over anchors [Bt,A] of sequences seqs [Bt,T] (module docstring).
    Returns (loss, per-slot metrics dict of [γ] arrays)."""
    cfg = params.config
    drafter = dspark.DSpark(weights, temps, dcfg)
    g = dcfg.block_size
    Bt, T = seqs.shape
    A = anchors.shape[1]
    h, U = dspark.anchored_blocks(drafter, params, feats, seqs, anchors)     # [Bt,A,γ,.]
    h, U = h.reshape(Bt, A * g, -1), U.reshape(Bt, A * g, -1)
    slot = jnp.arange(g, dtype=jnp.int32)
    qpos = (anchors[:, :, None] + slot).reshape(Bt, A * g)                     # [Bt,Q]
    take = jax.vmap(lambda s, i: s[i])
    prev, label = take(seqs, qpos), take(seqs, qpos + 1)
    bias, e = dspark.markov(drafter, prev)
    logp_d = jax.nn.log_softmax(U + bias, axis=-1)
    p_d = jnp.exp(logp_d)
    t_logits = jnp.matmul(take(hn, qpos), params["head"], precision=jax.lax.Precision.HIGHEST)
    p_t = jax.lax.stop_gradient(jax.nn.softmax(t_logits, axis=-1))
    ce = -jnp.take_along_axis(logp_d, label[..., None], -1)[..., 0]
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    c = dspark.confidence_logits(drafter, h, e)
    c_star = jax.lax.stop_gradient(1.0 - 0.5 * l1)
    bce = jax.nn.softplus(c) - c * c_star
    wk = jnp.tile(jnp.exp(-slot.astype(jnp.float32) / 4.0), A)                # [Q]
    per = 0.1 * ce + 0.9 * l1 + bce                                            # [Bt,Q]
    loss = jnp.sum(per * wk) / (Bt * jnp.sum(wk))
    by_slot = lambda x: x.reshape(Bt, A, g).mean((0, 1))
    top1 = (jnp.argmax(U + bias, -1) == label).astype(jnp.float32)
    return loss, dict(ce=by_slot(ce), l1=by_slot(l1), accept=by_slot(c_star), top1=by_slot(top1),
                      bce=by_slot(bce))


def sample_anchors(rng, n_seq: int, A: int, lo: int, hi: int) -> np.ndarray:
    """A distinct anchors per sequence in [lo, hi] (P: the anchor's position)."""
    return np.stack([np.sort(rng.choice(np.arange(lo, hi + 1), A, replace=False))
                     for _ in range(n_seq)]).astype(np.int32)


# ------------------------------------------------------------------------------ evaluation
def acceptance_stats(out, rows) -> dict:
    """Acceptance of rows `rows` of a speculative output: steps, mean accepted, tau (mean
    tokens per step incl. the bonus), acceptance rate, and the conditional acceptance of
    slot k (P(g >= k | g >= k-1)) over steps that verified every draft."""
    acc, ver = np.asarray(out.accepted)[rows], np.asarray(out.verified)[rows]
    live = acc >= 0
    g, v = acc[live], ver[live]
    k_max = int(v.max())
    full = v == k_max
    cond = [float((g[full] >= k).sum() / max((g[full] >= k - 1).sum(), 1))
            for k in range(1, k_max + 1)]
    return dict(steps=int(live.sum()), mean_accepted=round(float(g.mean()), 4),
                tau=round(float(g.mean() + 1), 4), acceptance_rate=round(float(g.sum() / v.sum()), 4),
                conditional_acceptance_per_slot=[round(c, 4) for c in cond])


def sts_log(out, rows) -> tuple[np.ndarray, np.ndarray]:
    """Steps of a fixed-length run that verified all γ drafts: (conf logits [N,γ], g [N])."""
    acc, ver = np.asarray(out.accepted)[rows], np.asarray(out.verified)[rows]
    conf = np.asarray(out.draft_confidence)[rows]
    g = conf.shape[-1]
    keep = ver == g
    return conf[keep], acc[keep]


def calibrate(conf, accepted) -> tuple[list[float], dict]:
    from deepinfer_fn.speculative import schedule
    if hasattr(schedule, "sts_calibrate"):
        temps, report = schedule.sts_calibrate(conf, accepted)
        return [float(t) for t in temps], dict(report=_jsonable(report),
                                               source="schedule.sts_calibrate")
    return [1.0] * conf.shape[1], dict(source="uncalibrated (schedule.sts_calibrate missing)")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return round(float(x), 5)
    if isinstance(x, np.integer):
        return int(x)
    return x


# ------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="default: <default model>/dspark")
    ap.add_argument("--n-train", type=int, default=512, help="self-sampled training sequences")
    ap.add_argument("--n-val", type=int, default=64, help="held-out sequences (teacher-forced)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--gen-len", type=int, default=112)
    ap.add_argument("--train-seconds", type=float, default=300.0)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--tap", default="post", choices=dspark.TAPS)
    ap.add_argument("--layers", default="1,2,3", help="target_layer_ids")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-new", type=int, default=64)
    ap.add_argument("--compare-mtp", action="store_true", help="also evaluate the MTP drafter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-cache", default=None,
                    help="npz of the sampled data and target features (written if absent); "
                         "must match --tap/--layers and the sizes")
    args = ap.parse_args(argv)
    t0 = time.time()
    timings = {}
    from tokenizers import Tokenizer
    path = di.default_model_path()
    out_dir = args.out or os.path.join(path, "dspark")
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    params = di.load_params(path, dtype=jnp.float32)
    cfg = params.config
    dcfg = dspark.DSparkConfig.for_target(
        cfg, block_size=args.block_size, markov_rank=args.markov_rank,
        target_layer_ids=tuple(int(x) for x in args.layers.split(",")), tap=args.tap,
        noise_token_id=tok.token_to_id("<｜▁pad▁｜>"), num_stages=args.stages)

    # 1-2. data
    train_prompts = snippets(tok, "train", args.n_train, args.prompt_len, args.seed)
    val_prompts = snippets(tok, "val", args.n_val + args.eval_prompts, args.prompt_len,
                           args.seed + 1)
    eval_prompts, val_prompts = val_prompts[:args.eval_prompts], val_prompts[args.eval_prompts:]
    if args.data_cache and os.path.exists(args.data_cache):   # iterate on the recipe quickly
        cached = np.load(args.data_cache)
        seqs, feats, hn = cached["seqs"], cached["feats"], cached["hn"]
        timings["data_cache"] = args.data_cache
    else:
        seqs = self_samples(params, np.concatenate([train_prompts, val_prompts]), args.gen_len,
                            args.seed * 100_000, batch=64)
        timings["sample_seconds"] = round(time.time() - t0, 1)
        feats, hn = target_data(params, dcfg, seqs)
        timings["target_pass_seconds"] = round(time.time() - t0 - timings["sample_seconds"], 1)
        if args.data_cache:
            np.savez(args.data_cache, seqs=seqs, feats=feats, hn=hn)
    n_tr = args.n_train
    data = dict(seqs=seqs, feats=feats, hn=hn)
    train = {k: v[:n_tr] for k, v in data.items()}
    val = {k: v[n_tr:] for k, v in data.items()}
    print(f"data: {seqs.shape} sequences ({n_tr} train, {len(seqs) - n_tr} val), "
          f"{timings}", flush=True)

    # 3. training
    drafter = dspark.init_dspark(cfg, dcfg, jax.random.key(args.seed))
    lo, hi = args.prompt_len, seqs.shape[1] - 1 - dcfg.block_size
    warm = max(1, int(0.04 * args.max_steps))

    def lr_at(step, total):
        if step < warm:
            return args.lr * (step + 1) / warm
        return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    # AdamW without weight decay at unit rate, the step scaled by the scheduled rate.
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1.0, weight_decay=0.0))
    opt_state = opt.init(drafter.weights)
    temps = drafter.sts_temperatures

    @jax.jit
    def step_fn(w, opt_state, seqs, feats, hn, anchors, lr):
        (loss, m), grads = jax.value_and_grad(block_loss, has_aux=True)(
            w, temps, dcfg, params, seqs, feats, hn, anchors)
        updates, opt_state = opt.update(grads, opt_state, w)
        updates = jax.tree.map(lambda u: u * lr, updates)
        return optax.apply_updates(w, updates), opt_state, loss, m

    @jax.jit
    def eval_fn(w, seqs, feats, hn, anchors):
        return block_loss(w, temps, dcfg, params, seqs, feats, hn, anchors)

    def evaluate(w):
        rng = np.random.default_rng(7)
        tot, n = None, 0
        for i in range(0, len(val["seqs"]) - args.batch + 1, args.batch):
            sl = slice(i, i + args.batch)
            anchors = sample_anchors(rng, args.batch, args.anchors, lo, hi)
            loss, m = eval_fn(w, *(jnp.asarray(val[k][sl]) for k in ("seqs", "feats", "hn")),
                              jnp.asarray(anchors))
            m = {k: np.asarray(v) for k, v in m.items()} | {"loss": float(loss)}
            tot = m if tot is None else {k: tot[k] + m[k] for k in m}
            n += 1
        return {k: _jsonable(v / n) for k, v in tot.items()}

    rng = np.random.default_rng(args.seed + 2)
    w = drafter.weights
    log, t_train, step = [], time.time(), 0
    total = args.max_steps
    while step < total:
        idx = rng.choice(n_tr, args.batch, replace=False)
        anchors = sample_anchors(rng, args.batch, args.anchors, lo, hi)
        w, opt_state, loss, m = step_fn(w, opt_state, *(jnp.asarray(train[k][idx])
                                                         for k in ("seqs", "feats", "hn")),
                                        jnp.asarray(anchors), jnp.float32(lr_at(step, total)))
        step += 1
        if step == 1:
            jax.block_until_ready(w)
            t_first = time.time()           # after compilation
        if step == 21:   # fix the step count from the measured speed (fits the time budget)
            jax.block_until_ready(w)
            per = (time.time() - t_first) / 20
            total = min(args.max_steps, max(step + 1, int((args.train_seconds - (
                time.time() - t_train)) / per) + step))
            print(f"{per:.3f} s/step -> {total} steps", flush=True)
        if step % 50 == 0 or step == total:
            entry = dict(step=step, loss=round(float(loss), 4),
                         accept=[round(float(x), 3) for x in np.asarray(m["accept"])],
                         seconds=round(time.time() - t_train, 1))
            log.append(entry)
            print(entry, flush=True)
    timings["train_seconds"] = round(time.time() - t_train, 1)
    held_out = evaluate(w)
    print(f"held-out (teacher-forced): {held_out}", flush=True)
    drafter = dspark.DSpark(w, temps, dcfg)

    # 4-5. speculative evaluation on held-out prompts, STS calibration on the T = 1 log
    t_eval = time.time()
    results = {}
    both = np.concatenate([eval_prompts, eval_prompts])        # rows: T = 1, then greedy
    temps_rows = np.repeat([1.0, 0.0], len(eval_prompts))
    runs = [("dspark", dict(speculative="dspark", drafter=drafter))]
    if args.compare_mtp:
        runs += [(f"mtp{k}", dict(speculative="mtp", num_draft_tokens=k)) for k in (3, 5)]
    for name, kw in runs:
        out = di.generate(params, both, max_new_tokens=args.eval_new, temperature=temps_rows,
                          seed=10_000 + np.arange(len(both)), **kw)
        for half, rows in (("sampled_T1", slice(0, len(eval_prompts))),
                           ("greedy", slice(len(eval_prompts), None))):
            results[f"{name}_{half}"] = acceptance_stats(out, rows)
            print(f"{name} {half}: {results[f'{name}_{half}']}", flush=True)
        if name == "dspark":
            conf, acc = sts_log(out, slice(0, len(eval_prompts)))
            sts, cal = calibrate(conf, acc)
            print(f"STS temperatures {sts}", flush=True)
            os.makedirs(out_dir, exist_ok=True)   # the raw log, for re-calibration
            np.savez_compressed(os.path.join(out_dir, "sts_log.npz"), conf_logits=conf,
                                accepted=acc)
    timings["eval_seconds"] = round(time.time() - t_eval, 1)
    timings["total_seconds"] = round(time.time() - t0, 1)

    drafter = dspark.DSpark(w, jnp.asarray(sts, jnp.float32), dcfg)
    n_params = int(sum(x.size for x in jax.tree.leaves(w)))
    training = dict(args=vars(args), params=n_params, steps=step, log=log,
                    held_out_teacher_forced=held_out, speculative_eval=results,
                    eval_setup=dict(prompts=args.eval_prompts, prompt_len=args.prompt_len,
                                    new_tokens=args.eval_new, verify_len="fixed",
                                    source="held-out stdlib files (validation split)"),
                    sts=dict(temperatures=sts, steps_logged=int(len(conf)), **cal),
                    timings=timings)
    dspark.save_dspark(drafter, out_dir, extra=dict(training=training))
    print(f"saved {out_dir} ({n_params} params); timings {timings}", flush=True)


if __name__ == "__main__":
    main()
