"""lm-evaluation-harness integration: the model type `hf-kvcache` and the offline tasks shipped with the package.

`HFKVCacheLM` is lm-eval's HF model with a quantized KV cache (`kv_cache=<spec>`, the spec strings of
`make_cache`; lm-eval splits `--model_args` on commas, so write a spec's own commas as `;`:
`kv_cache=int4-g32:sink_tokens=4;residual_length=32`):
- generation tasks: every batch gets a fresh cache; lm-eval left-pads the batch and passes its attention mask,
  which the caches honour;
- loglikelihood tasks follow the decode protocol of `hf-kvcache eval`: a single forward pass over context +
  continuation never reads a cache, so each request's context is prefilled through a fresh cache in one forward (as
  `generate` prefills a prompt), and its continuation is then fed one token at a time, each scored token attending
  exactly to itself and to the stored (quantized) tokens before it. (Rolling loglikelihood, the perplexity tasks,
  decodes every token of a window that way.) Requests run one at a time.

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

        def __init__(self, pretrained=None, kv_cache: str = "none", dtype: str = "auto", device: str | None = None,
                     **kwargs):
            from ..presets import make_cache
            from ..models import DEFAULT_MODEL, load_model

            if "chunk" in kwargs:
                raise ValueError("kv_cache's chunked prefill (chunk=) is gone: loglikelihood requests now prefill the "
                                 "context in one forward and decode the continuation token by token; drop chunk=")
            if pretrained is None or isinstance(pretrained, str):
                torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
                model, tokenizer = load_model(pretrained or DEFAULT_MODEL, dtype=torch_dtype, device=device)
                kwargs.setdefault("tokenizer", tokenizer)
            else:
                model = pretrained
            self.kv_cache = _spec(kv_cache)
            make_cache(self.kv_cache, model)  # a bad spec fails now, with make_cache's message
            from ..patching import unfuse

            unfuse(model)  # a RotatedCache fuses again when its cache is built
            super().__init__(pretrained=model, backend="causal", **kwargs)

        def _new_cache(self):
            from ..presets import make_cache

            return make_cache(self.kv_cache, self.model)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            """`[(log p(continuation | context), whether greedy decoding gives it)]` of `[((context, continuation),
            context ids, continuation ids)]`, by the decode protocol (see the module docstring)."""
            import torch.nn.functional as F
            from tqdm.auto import tqdm

            from .forward import forward_with_cache

            out = []
            for request, context_enc, continuation_enc in tqdm(
                    requests, disable=disable_tqdm or self.rank != 0, desc="loglikelihood (decode protocol)"):
                n = len(continuation_enc)
                # as lm-eval's HF model: what does not fit max_length is cut from the left
                ids = torch.tensor((context_enc + continuation_enc)[-(self.max_length + 1):][:-1], device=self.device)
                split = ids.numel() - n + 1  # prefill through the last context token, which predicts cont[0]
                cache = self._new_cache()
                with torch.no_grad():
                    steps = [forward_with_cache(self.model, ids[None, :split], cache, logits_to_keep=1)[:, -1]]
                    for i in range(split, ids.numel()):
                        steps.append(forward_with_cache(self.model, ids[None, i : i + 1], cache)[:, -1])
                logp = F.log_softmax(torch.cat(steps).float(), dim=-1)  # (n, V)
                cont = torch.tensor(continuation_enc, device=logp.device)
                answer = (logp.gather(1, cont[:, None]).sum().item(), bool((logp.argmax(-1) == cont).all()))
                self.cache_hook.add_partial("loglikelihood", request, answer)
                out.append(answer)
            return out

        def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
            from .. import _compat

            generation_kwargs.update(_compat.cache_kwargs(self._new_cache(), self.model))
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
