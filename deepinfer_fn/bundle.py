"""A model bundle: params with the tokenizer and drafter saved next to them, from one call.

    model = di.load_model()                  # $DEEPINFER_MODEL_PATH, else the default model
    model = di.load_model("path/to/hf_dir")  # a checkpoint directory
    model = di.load_model("org/name")        # a hub id, through huggingface_hub's cache

What a checkpoint directory may hold besides config.json + model*.safetensors:

* `tokenizer.json` (+ `tokenizer_config.json`) -> `Model.tokenizer`, a `text.Tokenizer`, the
  object structured output compiles constraints against. Without one, a model with the real V4
  vocabulary size gets the V4 vocabulary (`structured.default_tokenizer()`), others none.
* `dspark/` (written by `speculative.save_dspark`) -> `Model.drafter`, a `speculative.DSpark`.
* MTP layers (`mtp.*` tensors) load into `Model.params` itself.

`Model.speculative` names the methods the bundle can run ("mtp", "dspark").

Where the weights come from (`resolve_source`): an existing directory; else a hub id `org/name`,
looked up in the Hugging Face cache (`HF_HUB_CACHE`, `HF_HOME`, read at the call) and
downloaded only when it is not cached and `HF_HUB_OFFLINE` is unset; `None` means
`$DEEPINFER_MODEL_PATH` (a directory or a hub id) when set, else the embedded default model.

`unpack(model_or_params, ...)` turns a `Model` or a bare `Params` into the (params, drafter,
tokenizer) that generation runs on, explicit arguments winning over the bundle's.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax.numpy as jnp

from deepinfer_fn import structured, text
from deepinfer_fn.checkpoint import CheckpointError, load_params
from deepinfer_fn.config import ModelConfig
from deepinfer_fn.default_model import default_model_path
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.params import Params
from deepinfer_fn.speculative.dspark import DSpark, check_target, load_dspark
from deepinfer_fn.validate import boolean, describe, float_dtype

__all__ = ["Model", "load_model", "unpack", "constraint_tokenizer", "resolve_source",
           "model_tokenizer", "model_drafter", "has_chat_tokens", "check_tokenizer",
           "hub_snapshot", "hub_cache_dir", "hub_offline", "is_hub_id", "MODEL_PATH_ENV",
           "HUB_FILES", "DRAFTER_DIR", "CHAT_ENCODING"]

MODEL_PATH_ENV = "DEEPINFER_MODEL_PATH"
HUB_FILES = ("*.json", "*.safetensors")   # what a hub download fetches (dspark/ included)
DRAFTER_DIR = "dspark"                    # a checkpoint's DSpark drafter sub-directory
CHAT_ENCODING = "deepseek_v4"             # V4's `text.Tokenizer.apply_chat` format

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = {"1", "ON", "YES", "TRUE"}


# ------------------------------------------------------------------------------- the bundle
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Model:
    """Params with what runs beside them: tokenizer, DSpark drafter, where they came from.

    params: the target model (MTP layers included when the checkpoint has them).
    tokenizer: a `text.Tokenizer` over at most `params.config.vocab_size` ids, or None.
    drafter: a `speculative.DSpark` built for these params, or None.
    path: the directory loaded; source: what was asked for (a path or a hub id).
    chat_encoding: the tokenizer's chat format ("deepseek_v4" / "deepseek_v41") when it has the
    V4 chat tokens (derived when None).
    """

    params: Params
    tokenizer: text.Tokenizer | None = None
    drafter: DSpark | None = None
    path: str | None = None
    source: str | None = None
    chat_encoding: str | None = None

    def __post_init__(self):
        if not isinstance(self.params, Params):
            raise ArgumentTypeError(f"Model: params must be deepinfer_fn.Params, got "
                                    f"{describe(self.params)}")
        check_tokenizer("Model", self.tokenizer, self.params.config)
        if self.drafter is not None:
            if not isinstance(self.drafter, DSpark):
                raise ArgumentTypeError(f"Model: drafter must be a speculative.DSpark or None, "
                                        f"got {describe(self.drafter)}")
            check_target(self.drafter.config, self.params.config)
        for name in ("path", "source", "chat_encoding"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ArgumentTypeError(f"Model: {name} must be a str or None, got "
                                        f"{describe(value)}")
        if self.chat_encoding is None and has_chat_tokens(self.tokenizer):
            object.__setattr__(self, "chat_encoding", self.tokenizer.chat_encoding)

    @property
    def config(self) -> ModelConfig:
        return self.params.config

    @property
    def speculative(self) -> tuple[str, ...]:
        """The speculative methods this bundle runs without extra arguments."""
        if self.params.config.is_v41:        # its DSpark stages are the mtp.* params
            return ("dspark",) if self.params["mtp"] else ()
        return (("mtp",) if len(self.params["mtp"]) else ()) + \
               (("dspark",) if self.drafter is not None else ())

    def __repr__(self):
        cfg = self.params.config
        return (f"Model({self.source or self.path!r}, layers={cfg.num_hidden_layers}, "
                f"vocab_size={cfg.vocab_size}, dtype={self.params.dtype}, "
                f"tokenizer={'yes' if self.tokenizer is not None else 'none'}, "
                f"speculative={self.speculative}, chat_encoding={self.chat_encoding!r})")


def has_chat_tokens(tokenizer) -> bool:
    """Whether `tokenizer` (a `text.Tokenizer` or None) carries every V4 chat special token."""
    if tokenizer is None:
        return False
    return all(tokenizer.token_to_id(t) in tokenizer.special_ids for t in tokenizer.chat_tokens())


def check_tokenizer(where: str, tokenizer, cfg: ModelConfig) -> None:
    """`tokenizer` is None or a `text.Tokenizer` whose ids fit the model's vocabulary."""
    if tokenizer is None:
        return
    if not isinstance(tokenizer, text.Tokenizer):
        hint = (" (wrap a tokenizers.Tokenizer with deepinfer_fn.text.load_tokenizer(model_dir))"
                if type(tokenizer).__module__.startswith("tokenizers") else "")
        raise ArgumentTypeError(f"{where}: tokenizer must be a deepinfer_fn.text.Tokenizer or "
                                f"None, got {describe(tokenizer)}{hint}")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ArgumentError(f"{where}: the tokenizer has {tokenizer.vocab_size} ids but the "
                            f"model's vocab_size is {cfg.vocab_size}: it belongs to another model")


# ------------------------------------------------------------------------------- unpacking
def unpack(model, *, speculative: str | None = None, drafter=None, tokenizer=None,
           where: str = "unpack"):
    """(params, drafter or None, tokenizer or None) of a `Model` or a bare `Params`.

    Explicit `drafter` / `tokenizer` win over the bundle's. The bundle's DSpark drafter is
    returned only for speculative="dspark" (plain and MTP decoding take none); a bundle without
    one raises ArgumentError naming the fix. `where` names the caller in messages.
    """
    if isinstance(model, Model):
        params, own_drafter, own_tokenizer = model.params, model.drafter, model.tokenizer
    elif isinstance(model, Params):
        params, own_drafter, own_tokenizer = model, None, None
    else:
        raise ArgumentTypeError(f"{where}: model must be a deepinfer_fn.Model (load_model(...)) or "
                                f"Params (load_params / init_params), got {describe(model)}")
    check_tokenizer(where, tokenizer, params.config)
    if drafter is None and speculative == "dspark":
        if isinstance(model, Model) and own_drafter is None and not params.config.is_v41:
            raise ArgumentError(
                f"{where}: speculative='dspark' but {model!r} has no DSpark drafter (no "
                f"{DRAFTER_DIR}/ directory next to its checkpoint); pass drafter="
                f"speculative.load_dspark(path, params)")
        drafter = own_drafter
    return params, drafter, own_tokenizer if tokenizer is None else tokenizer


def constraint_tokenizer(params: Params, tokenizer=None, *, where: str = "generate"):
    """The `text.Tokenizer` a constraint compiles against: `tokenizer` (e.g. a bundle's), else
    the V4 vocabulary (`structured.default_tokenizer()`) when the model's vocabulary holds it;
    else ArgumentError telling how to pass the model's own."""
    cfg = params.config
    if tokenizer is not None:
        check_tokenizer(where, tokenizer, cfg)
        return tokenizer
    default = structured.default_tokenizer()
    if default.vocab_size > cfg.vocab_size:
        raise ArgumentError(
            f"{where}: constraint= needs the model's tokenizer: vocab_size {cfg.vocab_size} is "
            f"smaller than the default DeepSeek-V4 vocabulary's {default.vocab_size}; pass a "
            f"Model from deepinfer_fn.load_model(dir) or tokenizer=text.load_tokenizer(dir)")
    return default


# ------------------------------------------------------------------------------- sources
def is_hub_id(name: str) -> bool:
    """`org/name` spelled as the hub allows (not a relative path such as ./x or ../x)."""
    return bool(_HUB_ID.match(name)) and not name.startswith(".") and ".." not in name


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, with huggingface_hub's spelling."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def hub_cache_dir() -> str:
    """The Hugging Face hub cache as the environment says now: HF_HUB_CACHE, else
    HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (huggingface_hub reads these once, at
    its import; reading them per call lets a process move its cache)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expandvars(os.path.expanduser(explicit))
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return os.path.join(os.path.expandvars(os.path.expanduser(home)), "hub")


def hub_snapshot(repo_id: str, *, revision: str | None = None,
                 cache_dir: str | os.PathLike | None = None, on_download=None) -> str:
    """The local snapshot directory of hub repo `org/name`: the cached snapshot when there is
    one (no network), else a download of its `HUB_FILES` unless offline (`on_download(message)`
    is called first, e.g. to tell a user). CheckpointError naming the repo, the cache and the
    fix otherwise."""
    import huggingface_hub as hf
    cache = os.fspath(cache_dir) if cache_dir is not None else hub_cache_dir()
    try:
        return hf.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                    allow_patterns=list(HUB_FILES), local_files_only=True)
    except FileNotFoundError:            # LocalEntryNotFoundError: not (fully) in the cache
        pass
    except ValueError as e:              # HFValidationError: not a valid repo id / revision
        raise CheckpointError(f"hub id {repo_id!r}: {e}") from e
    if hub_offline():
        raise CheckpointError(
            f"hub id {repo_id}{'@' + revision if revision else ''} is not in the Hugging Face "
            f"cache {cache} and HF_HUB_OFFLINE is set: download it first (`hf download "
            f"{repo_id}`), unset HF_HUB_OFFLINE, or pass a checkpoint directory")
    if on_download is not None:
        on_download(f"{repo_id} is not in the Hugging Face cache {cache}; downloading it")
    try:
        return hf.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                    allow_patterns=list(HUB_FILES))
    except Exception as e:               # not found, gated, no network, ...
        raise CheckpointError(f"hub id {repo_id}: not in the cache {cache} and the download "
                              f"failed ({type(e).__name__}: {e})") from e


def resolve_source(source: str | os.PathLike | None = None, *, revision: str | None = None,
                   cache_dir: str | os.PathLike | None = None, on_download=None) -> str:
    """The checkpoint directory `source` names (see the module docstring).

    Raises ArgumentTypeError for a non-path, CheckpointError for a file, a missing directory
    that is no hub id, or a hub id that is neither cached nor downloadable."""
    if source is None:
        source = os.environ.get(MODEL_PATH_ENV, "").strip()
        if not source:
            return default_model_path()
        where = f"{MODEL_PATH_ENV}={source}"
    elif isinstance(source, (str, os.PathLike)) and not isinstance(source, bytes):
        source = os.fspath(source)
        where = repr(source)
    else:
        raise ArgumentTypeError(f"load_model: source must be a checkpoint directory, a hub id "
                                f"'org/name' or None, got {describe(source)}")
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.exists(path):
        raise CheckpointError(f"{where} is a file; pass the checkpoint directory that holds "
                              f"config.json")
    if is_hub_id(source):
        return hub_snapshot(source, revision=revision, cache_dir=cache_dir,
                            on_download=on_download)
    raise CheckpointError(f"{where}: no such directory, and not a hub id (org/name)")


# ------------------------------------------------------------------------------- loading
def model_tokenizer(path: str | None, cfg: ModelConfig) -> text.Tokenizer | None:
    """The tokenizer saved in checkpoint directory `path`; without one (or with no `path`,
    e.g. a preset), the V4 vocabulary if the model's vocab_size is V4's, else None."""
    if path is not None and os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer = text.load_tokenizer(path)
    elif cfg.vocab_size == ModelConfig.preset("v4-flash").vocab_size:
        tokenizer = structured.default_tokenizer()   # shared: llguidance's tables built once
    else:
        return None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path}/tokenizer.json has {tokenizer.vocab_size} ids but "
                              f"config.json's vocab_size is {cfg.vocab_size}")
    return tokenizer.with_chat_encoding(text.chat_encoding_of(cfg))


def model_drafter(path: str, params: Params, dtype, drafter) -> DSpark | None:
    """The DSpark drafter: `drafter` True -> `path/dspark/` when present, False -> none, a
    path -> that drafter directory (required). A V4.1 checkpoint has none: its DSpark
    stages are the mtp.* tensors in `params` (`speculative.dspark_v41`)."""
    if drafter is False:
        return None
    if params.config.is_v41:
        if drafter is True:
            return None
        raise ArgumentError(f"load_model: drafter={drafter!r}, but a DeepSeek-V4.1 checkpoint "
                            f"carries its DSpark drafter as its mtp.* tensors (drafter=True)")
    if drafter is True:
        where = os.path.join(path, DRAFTER_DIR)
        if not os.path.isdir(where):
            return None
    else:
        where = os.fspath(drafter)
    return load_dspark(where, params, dtype)


def load_model(source: str | os.PathLike | None = None, *, dtype=None, mesh=None,
               drafter: bool | str | os.PathLike = True, revision: str | None = None,
               cache_dir: str | os.PathLike | None = None, progress: bool = False,
               engram_store: str = "device") -> Model:
    """Loads a `Model`: params, tokenizer and drafter from one checkpoint directory.

    source: a checkpoint directory, a hub id `org/name`, or None (`$DEEPINFER_MODEL_PATH`,
    else the embedded default model). dtype: weights and drafter dtype (None: float32).
    mesh: shard the params as `load_params(mesh=)` does. drafter: True loads `dspark/` when
    present, False skips it, a path loads the drafter there. revision / cache_dir: for a hub id.
    engram_store (V4.1): "device" (default) or "host", as in `load_params`: "host" keeps the
    Engram tables memory-mapped in host memory (needed when they do not fit the devices).
    Raises ArgumentTypeError / CheckpointError / DSparkError naming the problem.
    """
    if not (isinstance(drafter, bool) or isinstance(drafter, (str, os.PathLike))):
        raise ArgumentTypeError(f"load_model: drafter must be True, False or a DSpark "
                                f"directory, got {describe(drafter)}")
    if revision is not None and not isinstance(revision, str):
        raise ArgumentTypeError(f"load_model: revision must be a str or None, got "
                                f"{describe(revision)}")
    boolean("load_model", "progress", progress)
    dtype = jnp.float32 if dtype is None else float_dtype("load_model", "dtype", dtype)
    asked = source if source is not None else os.environ.get(MODEL_PATH_ENV, "").strip() or None
    path = resolve_source(source, revision=revision, cache_dir=cache_dir)
    params = load_params(path, dtype=dtype, mesh=mesh, progress=progress,
                         engram_store=engram_store)
    return Model(params, tokenizer=model_tokenizer(path, params.config),
                 drafter=model_drafter(path, params, dtype, drafter), path=path,
                 source=os.fspath(asked) if asked is not None else path)
