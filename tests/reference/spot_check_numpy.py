#!/usr/bin/env python
"""Spot-check tests/golden against the spec equations with numpy only (no torch).

    python tests/reference/spot_check_numpy.py [tests/golden]

Recomputes, for cfg_a: layer-0 attn_in / mlp_in / streams_out from embed_out and the stored
attn_out / mlp_out (mHC, spec §2.3), the layer-2 HCA compressor rows (§2.6), the logits from the
last streams (§2.10), the hash routing, and for cfg_a_mtp the MTP input streams and logits (§2.11).
"""
import os
import sys

import numpy as np
from safetensors.numpy import load_file

EPS = 1e-6


def rms(x):
    return (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)).astype(np.float64)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def mhc(X, fn, base, scale, n=4, iters=20, hc_eps=1e-6):
    z = rms(X.reshape(*X.shape[:-2], -1))
    u = z @ fn.T
    pre = sigmoid(scale[0] * u[..., :n] + base[:n]) + hc_eps
    post = 2 * sigmoid(scale[1] * u[..., n : 2 * n] + base[n : 2 * n])
    M = scale[2] * u[..., 2 * n :].reshape(*u.shape[:-1], n, n) + base[2 * n :].reshape(n, n)
    P = np.exp(M - M.max(-1, keepdims=True))
    P = P / P.sum(-1, keepdims=True) + hc_eps
    P = P / (P.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        P = P / (P.sum(-1, keepdims=True) + hc_eps)
        P = P / (P.sum(-2, keepdims=True) + hc_eps)
    return pre, post, P


def head(X, fn, base, scale, norm_w, head_w):
    B, S = X.shape[:2]
    pre = sigmoid(scale * (rms(X.reshape(B, S, -1)) @ fn.T) + base) + 1e-6
    return (norm_w * rms((pre[..., None] * X).sum(2))) @ head_w.T


def rope(x, freqs, pos):
    rd = 2 * len(freqs)
    th = pos[:, None] * freqs[None]
    a, b = x[..., -rd::2].copy(), x[..., -rd + 1 :: 2].copy()
    x = x.copy()
    x[..., -rd::2] = a * np.cos(th) - b * np.sin(th)
    x[..., -rd + 1 :: 2] = a * np.sin(th) + b * np.cos(th)
    return x


def main(root):
    r = load_file(os.path.join(root, "cfg_a/reference.safetensors"))
    w = load_file(os.path.join(root, "cfg_a/model.safetensors"))
    res = {}
    X = np.repeat(r["embed_out"][:, :, None], 4, 2)
    p = "model.layers.0."
    pre, post, P = mhc(X, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"])
    res["attn_in0"] = w[p + "attn_norm.weight"] * rms((pre[..., None] * X).sum(2)) - r["layers.0.attn_in"]
    X1 = post[..., None] * r["layers.0.attn_out"][:, :, None] + np.einsum("bsjk,bsjd->bskd", P, X)
    pre, post, P = mhc(X1, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"])
    res["mlp_in0"] = w[p + "ffn_norm.weight"] * rms((pre[..., None] * X1).sum(2)) - r["layers.0.mlp_in"]
    X2 = post[..., None] * r["layers.0.mlp_out"][:, :, None] + np.einsum("bsjk,bsjd->bskd", P, X1)
    res["streams_out0"] = X2 - r["layers.0.streams_out"]

    p, m = "model.layers.2.attn.compressor.", 16  # HCA layer of cfg_a
    x = r["layers.2.attn_in"]
    B, S, _ = x.shape
    N = S // m
    kv = (x @ w[p + "wkv.weight"].T)[:, : N * m].reshape(B, N, m, -1)
    g = (x @ w[p + "wgate.weight"].T)[:, : N * m].reshape(B, N, m, -1) + w[p + "ape"]
    sm = np.exp(g - g.max(2, keepdims=True))
    sm /= sm.sum(2, keepdims=True)
    rows = rope(w[p + "norm.weight"] * rms((sm * kv).sum(2)), r["rope.compress_inv_freq"], np.arange(N) * m)
    res["hca_rows2"] = rows - r["layers.2.compressor_out"]

    Xl = r["layers.3.streams_out"]
    res["logits"] = (
        head(Xl, w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"], w["model.hc_head.hc_scale"],
             w["model.norm.weight"], w["head.weight"]) - r["logits"]
    )
    tid = w["model.layers.0.ffn.gate.tid2eid"]
    assert (np.sort(tid[r["input_ids"].reshape(-1)], -1) == r["layers.0.router_idx"]).all(), "hash routing"

    mw = load_file(os.path.join(root, "cfg_a_mtp/model.safetensors"))
    mr = load_file(os.path.join(root, "cfg_a_mtp/reference.safetensors"))
    assert (mr["input_ids"] == r["input_ids"]).all()
    e = mw["model.embed_tokens.weight"][mr["input_ids"][:, 1:]]
    xe = (mw["mtp.0.enorm.weight"] * rms(e)) @ mw["mtp.0.e_proj.weight"].T
    xh = (mw["mtp.0.hnorm.weight"] * rms(Xl[:, :-1])) @ mw["mtp.0.h_proj.weight"].T
    res["mtp_in"] = xe[:, :, None] + xh - mr["mtp_in_streams"]
    res["mtp_logits"] = (
        head(mr["mtp_block_streams_out"], mw["mtp.0.hc_head_fn"], mw["mtp.0.hc_head_base"],
             mw["mtp.0.hc_head_scale"], mw["mtp.0.norm.weight"], mw["head.weight"]) - mr["mtp_logits"]
    )
    ok = True
    for k, d in res.items():
        err = float(np.abs(d).max())
        ok &= err < 2e-5
        print(f"{k:14s} max abs diff {err:.2e}")
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tests/golden"))
