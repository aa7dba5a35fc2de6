"""Turns steps into tensors, runs the stage model, samples. The only torch module in runtime.

Called from the stage's engine thread only (stage/engine.py), so nothing here locks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..model.errors import ContextOverflowError, RequestError
from ..model.grammar import GrammarCompiler
from ..model.llama import Segment, StageModel
from ..model.sampling import RequestSampler, token_logprobs
from ..protocol.activation_codec import q8_decode, q8_encode
from ..protocol.constants import ActivationDtype
from ..protocol.sampling_config import SamplingConfig
from .session import MAX_OPEN_WINDOWS, Session, SessionError, VerifyCheckpoint
from .speculation import MAX_WINDOW_TOKENS
from .step import SampleMode, Step, StepResult


# A batched decode step's greedy picks are made in the layers' call (StageModel.forward's
# `greedy`), where each row's logits are still in cache; a lone row keeps the sampler's pick
# after the call, whose time stage 0's API loop uses on a shared machine (docs/decisions.md,
# 2026-12-05).
PICK_MIN_STEPS = 2

# Rows a frame may ask logits of (docs/protocol.md §8.1): a verify window's (stage 0's windows
# carry at most MAX_WINDOW_TOKENS drafts and the current token) and a prompt chunk's with
# prompt logprobs (stage 0 cuts prompts into 256-row chunks). Each row's logits take 4 bytes
# a token of the vocabulary (192 KiB for SmolLM2): a context-long window would ask for GBs.
MAX_WINDOW_ROWS = MAX_WINDOW_TOKENS + 1
MAX_PROMPT_LOGPROB_ROWS = 1024


def rows_to_tensor(rows: np.ndarray, dtype: ActivationDtype) -> torch.Tensor:
    """Wire rows (f32, f16, bf16 as uint16 bits, q8 as Q8_BLOCK records) -> float32 tensor.
    `rows` must be writable."""
    if dtype == ActivationDtype.bf16:
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16).float()
    if dtype == ActivationDtype.q8:
        return torch.from_numpy(q8_decode(rows))
    return torch.from_numpy(rows).float()


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


def _check_picks(logits: torch.Tensor, tokens: list[int], bias: dict[int, float]) -> None:
    """Each picked token's logit plus its bias must be a number above -inf: a greedy pick lands
    on a NaN whenever its row holds one, and on -inf only when every token is banned; either
    way the request fails (RequestError) instead of reading on with a meaningless token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        picked = [float(values[i, token]) for i, token in enumerate(tokens)]
    else:
        index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
        picked = logits.gather(1, index)[:, 0].tolist()
    for value, token in zip(picked, tokens):
        value += bias.get(token, 0.0)
        if not value > -math.inf:
            raise RequestError("Expected finite logits, got NaN (the row's activations overflowed)"
                               if value != value else "Expected some token the sampling settings allow, "
                               "got none: logit_bias and the grammar ban every token")


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
        """One forward over every step that passes its checks; per-step errors are returned, so
        one session's step never fails another's (inputs checked before the forward, each
        row's logits, sampler and grammar after it)."""
        results: list[StepResult | Exception | None] = [None] * len(steps)
        ready, aligned = [], {}
        for i, step in enumerate(steps):
            try:
                self._check_inputs(step)
                aligned[i] = self._prepare(step)
                ready.append(i)
            except (SessionError, ContextOverflowError, ValueError) as error:
                results[i] = error
        if ready:
            with torch.inference_mode():
                self._forward([steps[i] for i in ready], [aligned[i] for i in ready], ready,
                              results)
        return results  # type: ignore[return-value]

    def _check_inputs(self, step: Step) -> None:
        """What a step's frame carries, checked before it touches the session or a forward: token
        ids inside the vocabulary, and on later stages one finite activation row per compute
        row (a NaN row would leave the sampler nothing to draw from: docs/protocol.md §7.1)."""
        if step.window_id is not None:
            if step.num_rows > MAX_WINDOW_ROWS:
                raise RequestError(f"Expected a verify window of at most {MAX_WINDOW_ROWS} rows, got "
                                   f"{step.num_rows}")
            windows = step.session.verify_windows
            if step.window_id not in windows and len(windows) >= MAX_OPEN_WINDOWS:
                raise RequestError(f"Expected at most {MAX_OPEN_WINDOWS} verify windows open in a session "
                                   "(RetireVerifyWindow frees them), got one more")
        elif step.num_rows > MAX_PROMPT_LOGPROB_ROWS and self._wants_prompt_logprobs(step):
            raise RequestError(f"Expected a prompt chunk of at most {MAX_PROMPT_LOGPROB_ROWS} rows with "
                               f"prompt logprobs, got {step.num_rows}")
        tokens, vocab = step.tokens, self.model.args.vocab_size
        if tokens and not (0 <= min(tokens) and max(tokens) < vocab):
            bad = next(t for t in tokens if not 0 <= t < vocab)
            raise RequestError(f"Expected token ids in [0, {vocab}) (the vocabulary), got {bad} "
                               f"at row {tokens.index(bad)}")
        if self.is_first:
            return
        rows = step.rows
        if rows is None or rows.shape[0] != step.num_rows:
            raise RequestError(f"Expected {step.num_rows} activation rows, got "
                               f"{'none' if rows is None else rows.shape[0]}")
        if step.rows_dtype == ActivationDtype.bf16:
            finite = (rows & 0x7F80) != 0x7F80
        elif step.rows_dtype == ActivationDtype.q8:
            finite = np.isfinite(rows["d"])  # per block (its codes are integers)
        else:
            finite = np.isfinite(rows)
        if not finite.all():
            row = int(np.argwhere(~finite)[0][0])
            raise RequestError(f"Expected finite activations, got a NaN or infinity in row {row} "
                               f"of {step.num_rows}")

    def _prepare(self, step: Step) -> int | None:
        session = step.session
        session.check_active()
        if session.cache is None:
            session.cache = self.model.new_cache(self.ctx_size)
        cache = session.cache
        if step.num_rows < 1:
            raise RequestError(f"Expected at least one row, got {step.num_rows}")
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
        elif all(s.rows_dtype == steps[0].rows_dtype for s in steps):
            x = rows_to_tensor(np.concatenate([s.rows for s in steps]), steps[0].rows_dtype)  # a writable copy
        else:  # sessions whose upstreams send different dtypes share the wave all the same
            x = torch.cat([rows_to_tensor(s.rows.copy(), s.rows_dtype) for s in steps])
        greedy = [self._greedy_bias(s) for s in steps] if self.is_last and len(steps) >= PICK_MIN_STEPS else None
        hidden = model.forward(x, [Segment(s.session.cache, s.start, s.num_rows) for s in steps], greedy)

        offsets, row = [], 0
        for s in steps:
            offsets.append(row)
            row += s.num_rows
        sampled = self._sample(steps, offsets, hidden)
        for step, offset, index, aligned_from, outcome in zip(steps, offsets, indices, aligned, sampled):
            if isinstance(outcome, Exception):
                results[index] = outcome
                continue
            tokens, logprobs, prompt_logprobs = outcome
            rows = None
            if step.out_dtype is not None:
                rows = tensor_to_rows(hidden[offset:offset + step.num_rows], step.out_dtype)
            results[index] = StepResult(rows, tokens, aligned_from, logprobs, prompt_logprobs)

    def _greedy_bias(self, step: Step) -> tuple[list[int], list[float]] | None:
        """The logit_bias of a decode step's greedy pick the forward may make (StageModel.forward)."""
        if step.sample is not SampleMode.LAST or step.num_rows != 1 or self._wants_prompt_logprobs(step):
            return None
        try:
            sampler = step.session.sampler or self._new_sampler(step.session)
        except Exception:  # noqa: BLE001 - no pick in the forward; the step's own sampling fails alone
            return None
        return sampler.greedy_bias(self.model.args.vocab_size)

    def _wants_prompt_logprobs(self, step: Step) -> bool:
        """A prompt chunk of a request with prompt logprobs, on the stage with the head."""
        sampling = step.session.sampling
        return (self.is_last and sampling is not None and sampling.prompt_logprobs
                and step.window_id is None and step.start < step.session.prompt_token_count)

    def _sample(self, steps: list[Step], offsets: list[int], hidden: torch.Tensor) -> list:
        """(tokens, logprobs, prompt logprobs) per step; (None, None, None) where it samples
        nothing, and the exception where that step's sampling failed (that step only)."""
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
            num_logit_rows = (step.num_rows if step.sample is SampleMode.ALL or is_every
                              else int(step.sample is SampleMode.LAST))
            try:
                out.append(self._sample_step(step, offset, is_every, logits[row:row + num_logit_rows],
                                             picked))
            except Exception as error:  # noqa: BLE001 - this row's fault (or ours) fails its step only
                out.append(error)
            row += num_logit_rows
        return out

    def _sample_step(self, step: Step, offset: int, is_every: bool, logits: torch.Tensor,
                     picked: list[int | None] | None) -> tuple:
        """One step's (tokens, logprobs, prompt logprobs) from its rows' logits."""
        session = step.session
        prompt_logprobs = None
        if is_every:
            prompt_logprobs = self._prompt_logprobs(step, logits)
            logits = logits[step.num_rows - 1:]  # the last row samples
        if step.sample is SampleMode.NONE:
            return None, None, None
        sampler = session.sampler or self._new_sampler(session)
        if step.sample is SampleMode.LAST:
            mine = logits[:1]
            if picked is not None and picked[offset] is not None:
                tokens = [picked[offset]]  # the sampler's own greedy pick, made in the forward
            else:
                history = session.history(step.start + step.num_rows) if sampler.uses_history else ()
                tokens = [sampler.sample(mine[0], history)]
        else:
            mine = logits
            drafts = session.ledger[step.start + 1:step.start + step.num_rows]
            history = session.history(step.start + 1) if sampler.uses_history else ()
            tokens = list(sampler.sample(mine, history, drafts))
        _check_picks(mine, tokens, sampler.config.logit_bias)
        num_top = session.sampling.logprobs if session.sampling is not None else None
        logprobs = None if num_top is None else token_logprobs(mine, tokens, num_top)
        if self.record_logits:
            self.last_logits[session.key] = (mine[0] if step.sample is SampleMode.LAST else mine).clone()
        return tokens, logprobs, prompt_logprobs

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
        """`skip_draws`: the draws a replayed request's sampler already made (final stage; any
        count up to 2^31 - 1 skips in constant time and memory: sampling.Draws)."""
        if skip_draws < 0:
            raise RequestError(f"Expected decode_step >= 0 (the draws a request already made), got {skip_draws}")
        if session.prompt_token_count > self.ctx_size:
            raise RequestError(f"Expected prompt_token_count <= {self.ctx_size} (the context size), got "
                               f"{session.prompt_token_count}")
        session.sampling = sampling
        session.sampler = self._new_sampler(session) if self.is_last else None
        if session.sampler is not None:
            session.sampler.skip_draws(skip_draws)

    def _new_sampler(self, session: Session) -> RequestSampler:
        sampling, grammar = session.sampling or SamplingConfig(), None
        if sampling.grammar is not None:
            if self.grammars is None:
                raise RequestError(f"stage {self.model.layers} has no grammar engine for a request "
                                 "with a response_format grammar")
            # the output starts after the prompt; the state follows the ledger from there
            grammar = self.grammars.state(sampling.grammar, session.prompt_token_count)
        session.sampler = RequestSampler(sampling, self.model.device, grammar, self.model.args.vocab_size)
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
