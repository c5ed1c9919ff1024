"""`RankDedupDispatcher`: the MoE layer's token exchange, each token sent once to each
expert-parallel rank that holds any of its experts (megatron-core's all-to-all dispatcher sends
one copy per chosen expert).

With ep ranks R, E experts (rank r holds experts [r E/R, (r+1) E/R)), T local tokens and top-k
routing, one layer's forward is:
  1. route: each token's k experts (ascending) and weights from the router's routing map and
     probabilities [T, E]; per rank, the tokens it needs (`sent` [R, T]) and their local expert
     ids (-1: not on that rank);
  2. exchange counts: per destination rank, tokens and tokens per local expert (one small
     all-to-all, one host copy: the all-to-all's split sizes live on the host);
  3. dispatch: the S = sum(sent) token rows, rank-major and in token order (`copy_rows`), and
     per row its k weights and local expert ids (float32 [S, 2k]), one all-to-all each;
  4. on the receiving rank: the received rows copied to one row per (row, local expert),
     sorted by expert, stable (`copy_rows`) -> `GroupedExperts`, which applies the weights;
  5. combine: each received row's expert outputs summed (`sum_copies`), sent back by the
     reverse all-to-all, and each token's rows from the R ranks summed (`sum_copies`).
A token's copies cross the network at most once per remote rank: with 8 of 128 experts on
ep = 2, about 1 remote row a token where the per-expert exchange sends 4. The sums are float32
and free of atomics (`mtprun.kernels.row_copies`), and with ep = 1 steps 2, 3 and 5's
exchange are skipped (no host copy at all). Gradients flow through the same steps backwards
(megatron-core's autograd all-to-all; the weights' gradient returns to the router).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import all_to_all
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from mtprun.kernels.row_copies import RowCopies, copy_rows, sum_copies


class RankDedupDispatcher(MoETokenDispatcher):
    """megatron-core's dispatcher interface over the deduplicated exchange (module doc)."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: TransformerConfig,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size != 1:
            raise ValueError("the deduplicated dispatcher holds whole experts (expert tp 1)")
        rank = self.ep_group.rank() if self.ep_size > 1 else 0
        assert local_expert_indices[0] == rank * num_local_experts, "experts are rank-major"
        self.local_experts = num_local_experts
        self.top_k = config.moe_router_topk

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [S, B, H], routing_map [T, E] bool (k per row), probs [T, E] -> the rows to
        send [S', H] and their weights and local expert ids [S', 2k] (float32)."""
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens = x.shape[0]
        experts = torch.nonzero_static(routing_map, size=tokens * self.top_k)[:, 1]
        experts = experts.view(tokens, self.top_k)
        weights = probs.gather(1, experts).float()
        if self.ep_size == 1:
            self.tokens_per_expert = torch.bincount(experts.flatten(), minlength=self.local_experts)
            self.pairs = tokens * self.top_k
            return x, torch.cat([weights, experts.to(weights.dtype)], 1)
        ranks = torch.arange(self.ep_size, device=x.device)[:, None, None]
        for_rank = experts // self.local_experts == ranks  # [R, T, k]
        sent = for_rank.any(2)  # [R, T]
        self._exchange_counts(sent, experts)
        flat = sent.flatten()
        picked = torch.nonzero_static(flat, size=sum(self.send_splits))[:, 0]
        slots = torch.where(flat, flat.cumsum(0) - 1, -1).view(self.ep_size, tokens)
        self.sent = RowCopies(picked % tokens, slots.T.contiguous())
        local = torch.where(for_rank, experts - ranks * self.local_experts, -1)
        rows_weights = torch.where(for_rank, weights, 0.0).view(-1, self.top_k)[picked]
        rows_experts = local.view(-1, self.top_k)[picked].to(weights.dtype)
        return copy_rows(x, self.sent), torch.cat([rows_weights, rows_experts], 1)

    def _exchange_counts(self, sent: torch.Tensor, experts: torch.Tensor) -> None:
        """Split sizes both ways and this rank's tokens per local expert, on the host."""
        per_expert = torch.bincount(experts.flatten(), minlength=self.config.num_moe_experts)
        counts = torch.cat([sent.sum(1, keepdim=True), per_expert.view(self.ep_size, -1)], 1)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        host = torch.cat([counts[:, 0], received.flatten()]).tolist()
        self.send_splits = host[: self.ep_size]
        width = counts.shape[1]
        rows = [host[self.ep_size + r * width :][:width] for r in range(self.ep_size)]
        self.recv_splits = [row[0] for row in rows]
        per_expert = [sum(column) for column in zip(*rows, strict=True)][1:]
        self.tokens_per_expert = torch.tensor(per_expert)
        self.pairs = int(self.tokens_per_expert.sum())

    def token_dispatch(
        self, hidden_states: torch.Tensor, meta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ep_size == 1:
            return hidden_states, meta
        hidden_states = all_to_all(self.ep_group, hidden_states, self.recv_splits, self.send_splits)
        meta = all_to_all(self.ep_group, meta, self.recv_splits, self.send_splits)
        return hidden_states, meta

    def dispatch_postprocess(
        self, hidden_states: torch.Tensor, meta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Received rows [S_in, H] and meta [S_in, 2k] -> one row per (row, local expert) sorted
        by expert [P, H], tokens per local expert [E_local], their weights [P]."""
        weights, local = meta.split(self.top_k, dim=1)
        local = local.long().flatten()
        order = torch.argsort(torch.where(local >= 0, local, self.local_experts), stable=True)
        order = order[: self.pairs]
        slots = torch.full_like(local, -1)
        slots[order] = torch.arange(self.pairs, device=local.device)
        self.expanded = RowCopies(order // self.top_k, slots.view(-1, self.top_k))
        rows = copy_rows(hidden_states, self.expanded)
        return rows, self.tokens_per_expert, weights.flatten()[order]

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert outputs [P, H] (weighted) -> one summed row per received row [S_in, H]."""
        return sum_copies(hidden_states, self.expanded)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return hidden_states
        return all_to_all(self.ep_group, hidden_states, self.send_splits, self.recv_splits)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Rows back from every rank [S', H] -> each token's sum [S, B, H]."""
        if self.ep_size > 1:
            hidden_states = sum_copies(hidden_states, self.sent)
        return hidden_states.view(self.hidden_shape)
