"""Turns steps into tensors, runs the stage model, samples. The only torch module in runtime.

Called from the scheduler's worker thread only, so nothing here locks.
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.errors import ContextOverflowError
from ..model.grammar import GrammarCompiler
from ..model.llama import Segment, StageModel
from ..model.sampling import RequestSampler, token_logprobs
from ..protocol.activation_codec import q8_decode, q8_encode
from ..protocol.constants import ActivationDtype
from ..protocol.sampling_config import SamplingConfig
from .session import Session, SessionError, VerifyCheckpoint
from .step import SampleMode, Step, StepResult


# A batched decode step's greedy picks are made in the layers' call (StageModel.forward's
# `greedy`): read after the call, each row's 192 KiB of logits came back from the other
# core's caches and memory (an 8-row step's sampling 0.65 ms; 8 streams on 2 stages +4%).
# A lone row keeps the sampler's pick after the call: on 2 stages sharing 2 cores, those
# ~200 us of the final stage are when stage 0's API loop does its work for the last token
# in the other process; without them that work met stage 0's next step at the interpreter
# lock, and a served stream ran 9-12% slower (three interleaved A/Bs). On an Intel Xeon: 0.82x,
# and 0.99x once a team's threads claimed each other's matmul blocks (docs/architecture.md).
PICK_MIN_STEPS = 2


def rows_to_tensor(rows: np.ndarray, dtype: ActivationDtype) -> torch.Tensor:
    """Wire rows (f32, f16, bf16 as uint16 bits, q8 as Q8_BLOCK records) -> float32 tensor.
    `rows` must be writable."""
    if dtype == ActivationDtype.bf16:
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16).float()
    if dtype == ActivationDtype.q8:
        return torch.from_numpy(q8_decode(rows))
    return torch.from_numpy(rows).float()


def steps_to_tensor(steps: list[Step]) -> torch.Tensor:
    """The input rows of a batch's steps as one float32 tensor. Steps may carry different
    wire dtypes: a link's codec can send a prompt chunk in q8 and a short one in f16."""
    dtype = steps[0].rows_dtype
    if any(s.rows is None for s in steps):
        raise ValueError("later stages need input rows for every step")
    if all(s.rows_dtype == dtype for s in steps):
        return rows_to_tensor(np.concatenate([s.rows for s in steps]), dtype)  # a writable copy
    return torch.cat([rows_to_tensor(s.rows.copy(), s.rows_dtype) for s in steps])


def tensor_to_rows(hidden: torch.Tensor, dtype: ActivationDtype) -> np.ndarray:
    """float32 hidden [T, D] -> contiguous wire rows in `dtype` (bf16 as uint16 bits, q8 as
    Q8_BLOCK records: protocol/activation_codec.py)."""
    hidden = hidden.detach().cpu()
    if dtype == ActivationDtype.f32:
        return hidden.contiguous().numpy()
    if dtype == ActivationDtype.f16:
        return hidden.to(torch.float16).contiguous().numpy()
    if dtype == ActivationDtype.q8:
        return q8_encode(hidden.numpy())
    # round-to-nearest-even to bf16, then the raw bits
    return hidden.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


class Runner:
    def __init__(self, model: StageModel, ctx_size: int, *, record_logits: bool = False,
                 grammars: GrammarCompiler | None = None):
        """`grammars`: compiles the grammars of requests that constrain their output (the
        stage that samples needs it for them; None: such a request fails its configure)."""
        self.model = model
        self.grammars = grammars
        self.ctx_size = min(ctx_size, model.args.context_length)
        self.is_first, self.is_last = model.layers.is_first, model.layers.is_last
        self.record_logits = record_logits
        self.last_logits: dict = {}   # session key -> logits of its last sampled rows (tests)
        self._all_threads: int | None = None  # share_cores' whole

    @staticmethod
    def num_threads() -> int:
        """torch's intra-op threads (one process-wide setting, read from any thread)."""
        return torch.get_num_threads()

    def share_cores(self, ways: int) -> None:
        """Run the next forwards on 1 / `ways` of the threads the first call found (torch's,
        which size our kernels' OpenMP team too): a wave's share where stages share cores."""
        if self._all_threads is None:
            self._all_threads = torch.get_num_threads()
        threads = max(1, self._all_threads // ways)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    # -- iterations ---------------------------------------------------------------
    def run_batch(self, steps: list[Step]) -> list[StepResult | Exception]:
        """One forward over every step that passes its checks; per-step errors are returned."""
        results: list[StepResult | Exception | None] = [None] * len(steps)
        ready, aligned = [], {}
        for i, step in enumerate(steps):
            try:
                aligned[i] = self._prepare(step)
                ready.append(i)
            except (SessionError, ContextOverflowError, ValueError) as error:
                results[i] = error
        if ready:
            with torch.inference_mode():
                self._forward([steps[i] for i in ready], [aligned[i] for i in ready], ready,
                              results)
        return results  # type: ignore[return-value]

    def _prepare(self, step: Step) -> int | None:
        session = step.session
        session.check_active()
        if session.cache is None:
            session.cache = self.model.new_cache(self.ctx_size)
        cache = session.cache
        if step.num_rows < 1:
            raise ValueError(f"Expected at least one row, got {step.num_rows}")
        if step.start > cache.length:
            raise SessionError(f"position {step.start} is past the session's {cache.length} "
                               "positions (a chunk or step was lost)")
        if step.start + step.num_rows > cache.max_tokens:
            raise ContextOverflowError(f"Session needs {step.start + step.num_rows} positions but "
                                       f"its context size is {cache.max_tokens}")
        aligned_from = None
        if step.start < cache.length:  # auto-align: the authoritative start wins (spec §3.4)
            aligned_from = cache.length
            cache.truncate(step.start)
            session.num_auto_aligns += 1
        session.record_tokens(step.start, step.tokens, step.num_rows)
        if step.window_id is not None:
            session.verify_windows[step.window_id] = VerifyCheckpoint(
                step.window_id, step.start, step.num_rows, cache.checkpoint())
        return aligned_from

    def _forward(self, steps: list[Step], aligned: list[int | None], indices: list[int],
                 results: list) -> None:
        model = self.model
        if self.is_first:
            ids = [t for s in steps for t in s.tokens[:s.num_rows]]
            if len(ids) != sum(s.num_rows for s in steps):
                raise ValueError("the first stage needs a token id for every row")
            x = torch.tensor(ids, dtype=torch.long)
        else:
            x = steps_to_tensor(steps)
        greedy = [self._greedy_bias(s) for s in steps] if self.is_last and len(steps) >= PICK_MIN_STEPS else None
        hidden = model.forward(x, [Segment(s.session.cache, s.start, s.num_rows) for s in steps], greedy)

        offsets, row = [], 0
        for s in steps:
            offsets.append(row)
            row += s.num_rows
        sampled = self._sample(steps, offsets, hidden)
        for step, offset, index, aligned_from, (tokens, logprobs, prompt_logprobs) in zip(
                steps, offsets, indices, aligned, sampled):
            rows = None
            if step.out_dtype is not None:
                rows = tensor_to_rows(hidden[offset:offset + step.num_rows], step.out_dtype)
            results[index] = StepResult(rows, tokens, aligned_from, logprobs, prompt_logprobs)

    def _greedy_bias(self, step: Step) -> tuple[list[int], list[float]] | None:
        """The logit_bias of a decode step's greedy pick the forward may make (StageModel.forward)."""
        if step.sample is not SampleMode.LAST or step.num_rows != 1 or self._wants_prompt_logprobs(step):
            return None
        sampler = step.session.sampler or self._new_sampler(step.session)
        return sampler.greedy_bias(self.model.args.vocab_size)

    def _wants_prompt_logprobs(self, step: Step) -> bool:
        """A prompt chunk of a request with prompt logprobs, on the stage with the head."""
        sampling = step.session.sampling
        return (self.is_last and sampling is not None and sampling.prompt_logprobs
                and step.window_id is None and step.start < step.session.prompt_token_count)

    def _sample(self, steps: list[Step], offsets: list[int], hidden: torch.Tensor) -> list:
        """(tokens, logprobs, prompt logprobs) per step; (None, None, None) where it samples nothing."""
        picks: list[int] = []  # hidden rows whose logits are needed
        every_row = [self._wants_prompt_logprobs(step) for step in steps]
        for step, offset, is_every in zip(steps, offsets, every_row):
            if step.sample is SampleMode.ALL or is_every:
                picks.extend(range(offset, offset + step.num_rows))
            elif step.sample is SampleMode.LAST:
                picks.append(offset + step.num_rows - 1)
        if not picks:
            return [(None, None, None)] * len(steps)
        if not self.is_last:
            raise ValueError(f"stage {self.model.layers} has no output head to sample with")
        picked = self.model.step_picks(hidden)  # the greedy tokens the forward picked, by hidden row
        logits = self.model.compute_logits(hidden[picks] if len(picks) < hidden.shape[0] else hidden)
        out, row = [], 0
        for step, offset, is_every in zip(steps, offsets, every_row):
            session = step.session
            prompt_logprobs = None
            if is_every:
                prompt_logprobs = self._prompt_logprobs(step, logits[row:row + step.num_rows])
                row += step.num_rows - (step.sample is SampleMode.LAST)  # the last row samples
            if step.sample is SampleMode.NONE:
                out.append((None, None, None))
                continue
            sampler = session.sampler or self._new_sampler(session)
            if step.sample is SampleMode.LAST:
                mine = logits[row:row + 1]
                if picked is not None and picked[offset] is not None:
                    tokens = [picked[offset]]  # the sampler's own greedy pick, made in the forward
                else:
                    history = session.history(step.start + step.num_rows) if sampler.uses_history else ()
                    tokens = [sampler.sample(mine[0], history)]
                row += 1
            else:
                mine = logits[row:row + step.num_rows]
                drafts = session.ledger[step.start + 1:step.start + step.num_rows]
                history = session.history(step.start + 1) if sampler.uses_history else ()
                tokens = list(sampler.sample(mine, history, drafts))
                row += step.num_rows
            num_top = session.sampling.logprobs if session.sampling is not None else None
            logprobs = None if num_top is None else token_logprobs(mine, tokens, num_top)
            out.append((tokens, logprobs, prompt_logprobs))
            if self.record_logits:
                self.last_logits[session.key] = (mine[0] if step.sample is SampleMode.LAST else mine).clone()
        return out

    @staticmethod
    def _prompt_logprobs(step: Step, logits: torch.Tensor) -> list | None:
        """Note the logprobs of the prompt tokens this chunk's rows predict; on the chunk that
        samples (the prompt's last), return every prompt token's after the first, in order.

        Row p predicts the token at p + 1: within the chunk it is the ledger's next token; the
        chunk's last row waits in the session for the next chunk's first token."""
        session, start, num_top = step.session, step.start, step.session.sampling.logprobs
        prompt_end = session.prompt_token_count
        if start == 0:
            session.prompt_logprobs, session.pending_prompt_row = [], None
        pending, session.pending_prompt_row = session.pending_prompt_row, None
        if pending is not None and pending[0] == start - 1:
            session.prompt_logprobs += token_logprobs(pending[1][None], session.ledger[start:start + 1],
                                                      num_top)
        last = start + step.num_rows - 1
        num_known = max(0, min(last, prompt_end - 1) - start)  # rows whose next prompt token is here
        if num_known:
            session.prompt_logprobs += token_logprobs(
                logits[:num_known], session.ledger[start + 1:start + 1 + num_known], num_top)
        if last + 1 < prompt_end:
            session.pending_prompt_row = (last, logits[-1].clone())
        if step.sample is SampleMode.NONE:
            return None
        done, session.prompt_logprobs = session.prompt_logprobs, []
        return done

    # -- session operations ---------------------------------------------------------
    def configure(self, session: Session, sampling: SamplingConfig | None, skip_draws: int = 0) -> None:
        """`skip_draws`: the draws a replayed request's sampler already made (final stage)."""
        session.sampling = sampling
        session.sampler = self._new_sampler(session) if self.is_last else None
        if session.sampler is not None:
            session.sampler.skip_draws(skip_draws)

    def _new_sampler(self, session: Session) -> RequestSampler:
        sampling, grammar = session.sampling or SamplingConfig(), None
        if sampling.grammar is not None:
            if self.grammars is None:
                raise ValueError(f"stage {self.model.layers} has no grammar engine for a request "
                                 "with a response_format grammar")
            # the output starts after the prompt; the state follows the ledger from there
            grammar = self.grammars.state(sampling.grammar, session.prompt_token_count)
        session.sampler = RequestSampler(sampling, self.model.device, grammar)
        return session.sampler

    @staticmethod
    def trim(session: Session, num_tokens: int) -> int:
        """Cut the session to `num_tokens` positions (TrimSession); returns the old length."""
        session.check_active()
        length = 0 if session.cache is None else session.cache.length
        if num_tokens > length:
            raise SessionError(f"cannot trim a {length}-token session to {num_tokens} tokens")
        if session.cache is not None:
            session.cache.truncate(num_tokens)
        del session.ledger[num_tokens:]
        return length

    @staticmethod
    def retire(session: Session, start: int, count: int) -> int:
        """Free the checkpoints of verify windows based in [start, start + count)."""
        retired = session.retire_windows(start, count)
        if session.cache is not None:
            for window in retired:
                session.cache.release(window.checkpoint_id)
        return len(retired)
