"""Structured output: regular expressions, JSON schemas and Lark/EBNF grammars (llguidance).

A constraint is a small frozen spec -- `Regex(pattern)`, `JsonSchema(schema)`,
`Grammar(lark_text)` -- compiled per request by llguidance against an llguidance tokenizer built
once per `text.Tokenizer` from its `tokenizer.json`. The per-request `Matcher` walks the
request's tokens and gives packed allowed-token masks; `ConstrainedBatch` is the host side of a
batch (plain steps, speculative draft slots and commits); the jitted decode loops reach it
through the `io_callback` targets `host_step` / `host_draft` / `host_commit` and a session id
(`register`); `unpack_bitmask` turns packed masks into the sampler's bool mask on device. A
constraint that cannot be compiled does not raise: that request alone ends with
"error: ..." as its status.

Modules, one concept each:
  constraints  Regex, JsonSchema, Grammar, ConstraintError, grammar_text
  schema       JSON Schema keywords llguidance lacks, rewritten (approximate_schema), and the
               check of outputs against the original schema
  tokenizers   default_tokenizer, ll_tokenizer
  matcher      Matcher, fill_masks (many matchers' masks in one parallel llguidance call)
  batch        ConstrainedBatch (plain and speculative steps)
  callbacks    the decode loops' host callbacks and their session registry
  bitmask      mask_words, pack_mask, unpack_mask (host), unpack_bitmask (device)
  llg          the llguidance import, its shared executor, short error messages
"""

from deepinfer_fn.structured.bitmask import mask_words, pack_mask, unpack_bitmask, unpack_mask
from deepinfer_fn.structured.constraints import (Constraint, ConstraintError, Grammar, JsonSchema,
                                                 Regex, grammar_text, json_schema)
from deepinfer_fn.structured.schema import approximate_schema
from deepinfer_fn.structured.tokenizers import default_tokenizer, ll_tokenizer
from deepinfer_fn.structured.matcher import MASK_FAILED, UNSATISFIABLE, Matcher, fill_masks
from deepinfer_fn.structured.batch import ConstrainedBatch
from deepinfer_fn.structured.callbacks import (host_commit, host_draft, host_step, register,
                                               unregister)

__all__ = ["Regex", "JsonSchema", "Grammar", "Constraint", "ConstraintError", "grammar_text",
           "json_schema", "approximate_schema", "default_tokenizer", "ll_tokenizer", "Matcher",
           "fill_masks", "MASK_FAILED", "UNSATISFIABLE", "ConstrainedBatch", "register",
           "unregister", "host_step", "host_draft", "host_commit", "mask_words", "pack_mask",
           "unpack_mask", "unpack_bitmask"]
