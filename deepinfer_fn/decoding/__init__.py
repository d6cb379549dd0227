"""The pieces of `generate` / `stream_generate`, one concept per module (the public API is
`deepinfer_fn.generate`):

  output       GenerateOutput
  checks       host-side argument checks (check_prompts, check_stop_tokens, check_options,
               check_bounded_replay)
  prefill      chunked prefill (prefill, prefill_forward, prefill_chunks; V4.1 decoder SWA
               bounded replay), shape buckets
  plain        the jitted decode loop (decode_block, stop_array, decode_width, plain_blocks)
  constrained  the decode loop under per-step grammar masks (constrained_blocks)
  speculative  the speculative run: drafter prefill, then a while-loop of
               `speculative.loop.speculative_step` in segments (speculative_run)
  rows         mesh padding of the batch, per-row sampling parameters, state placement

This package's __init__ imports nothing, so importing one module (e.g. `decoding.prefill`
from the verify-cost measurement) does not pull in the others.
"""
