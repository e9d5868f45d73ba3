"""lm-evaluation-harness integration: the model type `hf-kvcache` and the offline tasks shipped with the package.

`HFKVCacheLM` is lm-eval's HF model with a quantized KV cache (`kv_cache=<spec>`, the spec strings of
`make_cache`; lm-eval splits `--model_args` on commas, so write a spec's own commas as `;`:
`kv_cache=int4-g32:sink_tokens=4;residual_length=32`):
- generation tasks: every batch gets a fresh cache; lm-eval left-pads the batch and passes its attention mask,
  which the caches honour;
- loglikelihood tasks: a single forward pass over context + continuation never reads a cache, so the input is
  prefilled THROUGH a fresh cache in chunks of `chunk` tokens (each chunk attends to the stored, quantized
  tokens before it and to its own exact tokens), and the logits of every chunk are what lm-eval scores. With the
  default chunk of 64, a short continuation attends to its own chunk exactly and to the quantized context before
  it: the streaming protocol of `hf-kvcache eval`.

`pretrained` is the embedded default (`smollm2-135m`, also the default), a local HF model directory or a .gguf
file (`hf_kvcache.load_model`); nothing is downloaded. lm-eval's command line does not discover third-party
models: run it through `hf-kvcache lm-eval ...`, which registers this model and adds the offline tasks' folder
(`tasks_dir()`, tasks `hf_kvcache_passkey`, ...) to `--include_path`.
"""

from __future__ import annotations

from pathlib import Path

import torch

MODEL_NAME = "hf-kvcache"


def tasks_dir() -> Path:
    """The folder of the offline lm-eval tasks shipped with the package."""
    return Path(__file__).with_name("lm_eval_tasks")


def _spec(kv_cache: str) -> str:
    return str(kv_cache).replace(";", ",")


def register() -> type:
    """Register the `hf-kvcache` model type in lm-eval (idempotent) and return its class. Needs `lm-eval`
    (`pip install hf-kvcache[eval]`)."""
    try:
        from lm_eval.api.registry import MODEL_REGISTRY, register_model
        from lm_eval.models.huggingface import HFLM
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("the lm-eval integration needs lm-eval: pip install 'hf-kvcache[eval]'") from error
    if MODEL_NAME in MODEL_REGISTRY:
        return MODEL_REGISTRY[MODEL_NAME]

    @register_model(MODEL_NAME)
    class HFKVCacheLM(HFLM):
        """lm-eval's HF model with a quantized KV cache (see the module docstring)."""

        def __init__(self, pretrained=None, kv_cache: str = "none", chunk: int = 64, dtype: str = "auto",
                     device: str | None = None, **kwargs):
            from .. import make_cache
            from ..models import DEFAULT_MODEL, load_model

            if pretrained is None or isinstance(pretrained, str):
                torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
                model, tokenizer = load_model(pretrained or DEFAULT_MODEL, dtype=torch_dtype, device=device)
                kwargs.setdefault("tokenizer", tokenizer)
            else:
                model = pretrained
            self.kv_cache = _spec(kv_cache)
            self.chunk = int(chunk)
            if self.chunk < 1:
                raise ValueError(f"chunk={chunk!r} must be a positive number of tokens")
            make_cache(self.kv_cache, model)  # a bad spec fails now, with make_cache's message
            from ..patching import unfuse

            unfuse(model)  # a RotatedCache fuses again when its cache is built
            super().__init__(pretrained=model, backend="causal", **kwargs)

        def _new_cache(self):
            from .. import make_cache

            return make_cache(self.kv_cache, self.model)

        def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
            """Logits `(B, L, V)` of right-padded `inps (B, L)`, prefilled through a fresh cache in chunks."""
            from .. import _compat

            cache = self._new_cache()
            out = []
            with torch.no_grad():
                for start in range(0, inps.shape[1], self.chunk):
                    step = self.model(inps[:, start : start + self.chunk], use_cache=True,
                                      **_compat.cache_kwargs(cache))
                    out.append(step.logits)
            return torch.cat(out, dim=1)

        def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
            from .. import _compat

            generation_kwargs.update(_compat.cache_kwargs(self._new_cache()))
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    return HFKVCacheLM


def cli(argv: list[str]) -> int:
    """`hf-kvcache lm-eval ARGS`: lm-eval's own command line (`lm-eval ARGS`) with the `hf-kvcache` model registered
    and the offline tasks' folder on `--include_path`."""
    import sys

    register()
    from lm_eval._cli import HarnessCLI

    argv = list(argv)
    if argv and argv[0] not in ("ls", "validate") and "--include_path" not in argv:
        argv += ["--include_path", str(tasks_dir())]
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        parser = HarnessCLI()
        parser.execute(parser.parse_args())
    finally:
        sys.argv = saved
    return 0
