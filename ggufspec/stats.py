"""Statistics of one generation, and the text blocks and tables that show them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """Counters in llama.cpp's `speculative` vocabulary (n_drafted, n_accept, ...), plus timings."""

    n_draft: int = 0            # K, the most tokens drafted per step
    n_prompt: int = 0           # prompt tokens
    n_prompt_cached: int = 0    # of which the KV cache already held (not evaluated again)
    prompt_seconds: float = 0.0  # target prefill
    n_predict: int = 0          # tokens generated
    decode_seconds: float = 0.0  # wall time from the end of prefill to the last token
    n_drafted: int = 0          # draft tokens proposed
    n_accept: int = 0           # of which the target kept
    n_steps: int = 0            # target verification batches
    n_draft_steps: int = 0      # of which verified drafts (llama-server's spec_decode_num_drafts)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    stop_reason: str = ""       # eos | n_predict | context | interrupted
    drafter: str = ""           # model | lookup | hybrid, "+auto" when K is chosen per step; none
    placement: dict = field(default_factory=dict)  # target blocks per host ("CPU", "host:port"), with --rpc
    costs: dict = field(default_factory=dict)      # --draft auto: measured step costs (Costs.summary)
    id_slot: int = 0            # the slot (sequence) it ran in (`slots`; 0 without --parallel)

    def add_step(self, n_drafted: int, n_accepted: int, draft_seconds: float, target_seconds: float) -> None:
        self.n_steps += 1
        self.n_draft_steps += n_drafted > 0
        self.n_drafted += n_drafted
        self.n_accept += n_accepted
        self.draft_seconds += draft_seconds
        self.target_seconds += target_seconds

    @property
    def acceptance(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_predict / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        evaluated = self.n_prompt - self.n_prompt_cached
        return evaluated / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "accept": self.acceptance, "decode_tps": self.decode_tps,
                "prompt_tps": self.prompt_tps}

    def llamacpp_block(self) -> str:
        """The block llama.cpp's speculative example prints at the end, then the time split."""
        return "\n".join([
            f"encoded {self.n_prompt:4d} tokens in {self.prompt_seconds:8.3f} seconds, "
            f"speed: {self.prompt_tps:8.3f} t/s ({self.n_prompt_cached} cached)",
            f"decoded {self.n_predict:4d} tokens in {self.decode_seconds:8.3f} seconds, "
            f"speed: {self.decode_tps:8.3f} t/s",
            "",
            f"n_draft   = {self.n_draft}" + (f" ({self.drafter})" if self.drafter not in ("", "model") else ""),
            f"n_predict = {self.n_predict}",
            f"n_drafted = {self.n_drafted}",
            f"n_accept  = {self.n_accept}",
            f"accept    = {100 * self.acceptance:.3f}%",
            "",
            f"draft:  {self.draft_seconds:8.3f} s",
            f"target: {self.target_seconds:8.3f} s ({self.n_steps} batches)",
            f"stop:   {self.stop_reason}",
        ] + (["target layers: " + ", ".join(f"{host} {n}" for host, n in self.placement.items())]
             if self.placement else [])
          + (["costs:  target batch of " + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in self.costs["target_ms"].items())
              + f"; draft {self.costs['draft_ms']:.2f} ms/token (measured)"] if self.costs.get("target_ms") else []))
