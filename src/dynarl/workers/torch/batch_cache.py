"""The running batch's KV cache: one left-padded ``transformers`` ``DynamicCache`` whose
rows join (after a batched prefill) and leave (when requests finish) between steps.

Every row's padding is on its left (and, for a row that reused a cached prefix, between
the prefix and the tokens it fed) and masked out, and every row's position ids count
only its real tokens, so a row computes what it would alone; a decode step feeds one
token per row (O(1) new tokens per step). Padding columns no row needs are trimmed
whenever rows leave. This works for any ``transformers`` causal LM whose cache layers are
plain full-attention ``DynamicLayer``s (Qwen2, Llama, Mistral without sliding window, ...);
other layer kinds are refused when the cache is first built.
"""

import inspect
from collections.abc import Sequence

import torch
from torch.nn import functional
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from dynarl.workers.torch.errors import EngineError
from dynarl.workers.torch.prefix_cache import CachedPrefix


class BatchCache:
    """KV cache, attention mask and next position of each row of the running batch.

    Rows are numbered in the order they joined; :meth:`keep` renumbers them.
    """

    def __init__(self, model: PreTrainedModel, *, pad_token_id: int) -> None:
        self._model = model
        self._pad_token_id = pad_token_id
        parameters = inspect.signature(model.forward).parameters
        # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns).
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in parameters
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)

    @property
    def num_rows(self) -> int:
        """Rows (running sequences) in the cache."""
        return int(self._positions.shape[0])

    @property
    def width_tokens(self) -> int:
        """Padded length of every row: the cache holds ``num_rows x width_tokens`` slots."""
        return int(self._mask.shape[1])

    def clear(self) -> None:
        """Drop every row and free the cache's memory."""
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)

    @torch.inference_mode()
    def prefill(
        self,
        contexts: Sequence[Sequence[int]],
        prefixes: Sequence[CachedPrefix | None] | None = None,
    ) -> torch.Tensor:
        """Run ``contexts`` through the model as one left-padded batch, append them as new
        rows, and return the next-token logits of each (``[len(contexts), vocab]``).

        A row with a cached prefix (``prefixes[row]``, whose tokens ``contexts[row]``
        extends) feeds only the tokens after it: the prefix's KV goes into the cache as
        it is, right-aligned before the fed columns (the padding between is masked).
        """
        device = self._model.device
        if prefixes is None:
            prefixes = [None] * len(contexts)
        cached = [0 if p is None else p.num_tokens for p in prefixes]
        fed = [context[n:] for context, n in zip(contexts, cached, strict=True)]
        past, width = max(cached), max(len(f) for f in fed)
        input_ids = torch.full((len(contexts), width), self._pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(contexts), past + width, dtype=torch.long)
        for row, (tokens, n) in enumerate(zip(fed, cached, strict=True)):
            input_ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, past + width - len(tokens) :] = 1
            mask[row, past - n : past] = 1
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)[:, past:]
        cache = DynamicCache(config=self._model.config)
        if past:
            self._fill_past(cache, prefixes, past)
        _full_attention_layers(cache, self._model)
        logits = self._forward(input_ids, mask, positions, cache)
        self._append(cache, mask.to(device), positions[:, -1].to(device) + 1)
        return logits

    def row_prefix(self, row: int, token_ids: tuple[int, ...]) -> CachedPrefix:
        """A copy of ``row``'s KV as a cached prefix of ``token_ids``, which must be the
        tokens the row has fed, in order."""
        assert self._cache is not None
        columns = self._mask[row].nonzero().squeeze(-1)
        assert columns.numel() == len(token_ids), "the row holds other tokens"
        layers = [_states(layer) for layer in _full_attention_layers(self._cache, self._model)]
        keys = [k[row : row + 1].index_select(2, columns) for k, _ in layers]
        values = [v[row : row + 1].index_select(2, columns) for _, v in layers]
        return CachedPrefix(token_ids, keys, values)

    def _fill_past(
        self, cache: DynamicCache, prefixes: Sequence[CachedPrefix | None], past: int
    ) -> None:
        """Put each prefix's KV into ``cache``, right-aligned in ``past`` columns."""
        some = next(p for p in prefixes if p is not None)
        for index, (layer_keys, layer_values) in enumerate(
            zip(some.keys, some.values, strict=True)
        ):
            shape = (len(prefixes), layer_keys.shape[1], past, layer_keys.shape[3])
            keys = layer_keys.new_zeros(shape)
            values = layer_values.new_zeros(shape)
            for row, prefix in enumerate(prefixes):
                if prefix is not None:
                    keys[row, :, past - prefix.num_tokens :] = prefix.keys[index][0]
                    values[row, :, past - prefix.num_tokens :] = prefix.values[index][0]
            cache.update(keys, values, index)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``[num_rows]``) and return the next-token logits."""
        assert self._cache is not None and token_ids.shape[0] == self.num_rows
        ones = torch.ones(self.num_rows, 1, dtype=torch.long, device=self._mask.device)
        mask = torch.cat([self._mask, ones], dim=1)
        logits = self._forward(
            token_ids.unsqueeze(-1), mask, self._positions.unsqueeze(-1), self._cache
        )
        self._mask = mask
        self._positions = self._positions + 1
        return logits

    @torch.inference_mode()
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order) and trim padding no remaining row needs."""
        if not rows:
            self.clear()
            return
        if list(rows) == list(range(self.num_rows)):
            return
        assert self._cache is not None
        index = torch.tensor(rows, dtype=torch.long, device=self._mask.device)
        mask = self._mask.index_select(0, index)
        start = int(mask.any(dim=0).nonzero()[0, 0])
        for layer in _full_attention_layers(self._cache, self._model):
            keys, values = _states(layer)
            layer.keys = keys.index_select(0, index)[:, :, start:]
            layer.values = values.index_select(0, index)[:, :, start:]
        self._mask = mask[:, start:]
        self._positions = self._positions.index_select(0, index)

    def _append(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        if self._cache is None:
            self._cache, self._mask, self._positions = cache, mask, positions
            return
        width = max(self.width_tokens, mask.shape[1])
        old_pad, new_pad = width - self.width_tokens, width - mask.shape[1]
        old_layers = _full_attention_layers(self._cache, self._model)
        new_layers = _full_attention_layers(cache, self._model)
        for old, new in zip(old_layers, new_layers, strict=True):
            (old_keys, old_values), (new_keys, new_values) = _states(old), _states(new)
            old.keys = torch.cat([_pad_left(old_keys, old_pad), _pad_left(new_keys, new_pad)])
            old.values = torch.cat([_pad_left(old_values, old_pad), _pad_left(new_values, new_pad)])
        self._mask = torch.cat(
            [functional.pad(self._mask, (old_pad, 0)), functional.pad(mask, (new_pad, 0))]
        )
        self._positions = torch.cat([self._positions, positions])

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        device = self._model.device
        kwargs: dict[str, object] = {
            "input_ids": input_ids.to(device),
            "attention_mask": mask.to(device),
            "position_ids": positions.to(device),
            self._cache_kwarg: cache,
            "use_cache": True,
        }
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits: torch.Tensor = self._model(**kwargs).logits
        return logits[:, -1, :]


def _pad_left(states: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[batch, heads, tokens, dim]`` states with ``num_tokens`` zero slots prepended."""
    return functional.pad(states, (0, 0, num_tokens, 0)) if num_tokens else states


def _full_attention_layers(cache: DynamicCache, model: PreTrainedModel) -> list[DynamicLayer]:
    """The cache's layers, which must all be plain full-attention ``DynamicLayer``s."""
    layers = [layer for layer in cache.layers if type(layer) is DynamicLayer]
    if len(layers) != len(cache.layers):
        raise EngineError(
            f"{type(model).__name__} uses cache layers other than full-attention "
            "DynamicLayer (sliding window, linear attention, ...), which the reference "
            "engine cannot batch; use a full-attention model"
        )
    return layers


def _states(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values."""
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values
