"""The KV hand-over of a simulated instance (cluster/sim/instance.py): both sides of it.

Receiving side: the capacity scheduler's disagg-init requests get their blocks reserved and a
reservation notice (DISAGG_GENERATION_TRANS_IN_PROGRESS) that expires after
engine.reservation_timeout_s without a commit; a committed transfer makes the request generate from
the next step. Sending side: a context-only request whose context is done holds its blocks for
engine.sender_lease_s; a push takes the link model's time (cluster/sim/link.py) plus the profile's
control-path cost, with the deployment's fault plan (worker/kv_transfer/faults.py) drawn per
transfer and chunk as the real sender and receiver draw them, and ends with a push result for the
router. worker/handover.py and worker/kv_transfer/ are what this models.

`HandoverSide` is a part of SimInstance (its base class), kept here so that each module has one
job: it reads and writes the instance's state (requests, blocks, mail, timers) as the step loop does.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.request import LlmRequest
from scheduler.state import LlmRequestState
from worker.instant import instant_token
from worker.kv_transfer.failures import FailureReason
from worker.kv_transfer.faults import FaultInjector, FaultSide
from worker.protocol import ErrorCode, PushResult, RequestError, ReservationNotice, SubmitRequest
from worker.stopping import FinishReason

S = LlmRequestState
BLOCKS_PER_CHUNK = 4  # transfer chunks a fault plan's chunk rules count (worker/kv_transfer/plan.py order)
_transfer_ids = itertools.count(1)


@dataclass(slots=True)  # its fields are read for every token of every request
class SimRequest:
    """A request on a simulated instance: its submission, its scheduler request, and its hand-over state."""

    submit: SubmitRequest
    llm: LlmRequest
    seed: int
    num_outputs: int  # output tokens so far, including those produced elsewhere
    max_tokens: int  # its sampling parameters' (read for every token)
    num_cached_tokens: int = 0
    transfer_id: str | None = None  # generation side: its reservation
    reserved: bool = False
    # Prefill side: what cancels its push in flight, which reads its blocks. At most one: a new push,
    # a release or an abort cancels it first (worker/instance.py cancels a push nobody waits for any
    # more), and a simulated cancel takes effect at once. So no end here waits for a push, where
    # worker/engine.py, whose cancel takes the sender's Abort, defers it (worker/handover.py).
    cancel_push: Callable[[str], None] | None = None
    # Prefill side: a push relayed while the context computes (an early reservation), started the
    # moment the context is done, as worker/engine.py Engine.defer_push keeps it. (Chunk streaming
    # is not modelled: the whole KV moves after the context.)
    pending_push: tuple[str, str, float, str] | None = None
    finished: bool = False
    expiry: asyncio.TimerHandle | None = None  # its lease or reservation timer, cancelled when it ends

    @property
    def pushes(self) -> int:
        """Prefill side: pushes in flight (0 or 1)."""
        return 0 if self.cancel_push is None else 1


class HandoverSide:
    """SimInstance's hand-over: reservations and their expiry, the sender's lease, pushes and their
    faults, commits."""

    def _reserve(self, requests: list[LlmRequest], now: float) -> None:
        for llm in requests:
            request = self._requests[llm.request_id]
            self.blocks.add_sequence(llm, reuse=False)
            num_blocks = len(self.blocks.block_ids(llm.request_id))
            transfer_id = f"t{next(_transfer_ids)}"
            request.transfer_id = transfer_id
            request.reserved = True
            expires_s = now + self.config.reservation_timeout_s
            self._reservations.append(
                ReservationNotice(llm.request_id, transfer_id, num_blocks, expires_s, self.config.reservation_timeout_s)
            )
            self._set_state(request, S.DISAGG_GENERATION_TRANS_IN_PROGRESS, f"reserved {num_blocks} blocks")
            request.expiry = self._at(expires_s, self._reservation_expired, request, transfer_id)

    def _reservation_expired(self, request: SimRequest, transfer_id: str) -> None:
        if request.finished or request.transfer_id != transfer_id or request.llm.state is not S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
            return
        detail = f"no KV committed within {self.config.reservation_timeout_s}s"
        error = RequestError(ErrorCode.RESERVATION_EXPIRED, detail, FailureReason.RESERVATION_EXPIRED.value)
        self._finish(request, S.DISAGG_TRANS_ERROR, 0, FinishReason.ERROR, error=error)
        self._after_change()

    def _lease_expired(self, request: SimRequest) -> None:
        if request.finished or request.cancel_push is not None or request.llm.state is not S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            return
        detail = f"KV not taken within the sender lease of {self.config.sender_lease_s}s"
        self._finish(request, S.DISAGG_TRANS_ERROR, 0, FinishReason.ERROR, error=RequestError(ErrorCode.LEASE_EXPIRED, detail))
        self._after_change()

    def _transfer(self, request: SimRequest, target: str, transfer_id: str, deadline_s: float, target_request_id: str) -> None:
        now = self._now()
        receiver = self.net.by_address.get(target)
        num_blocks = len(self.blocks.block_ids(request.submit.request_id))
        num_bytes = num_blocks * self.config.tokens_per_block * self.profile.kv_bytes_per_token
        control_s = self.profile.handover_fixed_s
        busy_s = self.profile.handover_busy_s
        if busy_s is not None and receiver is not None and receiver._stepping:
            control_s = busy_s  # the receiver is mid-step: it takes the KV in on shared cores
        failure: tuple[FailureReason, str] | None = None
        kill: HandoverSide | None = None
        extra_s = 0.0
        faults = self.net.faults
        if faults is not None:
            failure, kill, extra_s = self._draw_faults(faults, transfer_id, request.submit.request_id, receiver, num_blocks, deadline_s)
        if receiver is None or receiver.dead:
            failure = failure or (FailureReason.PEER_UNAVAILABLE, f"no KV receiver at {target}")
        if failure is not None and failure[0] is FailureReason.RESOURCE_EXHAUSTED:
            end_s = now + control_s / 2  # Prepare refused
        elif failure is not None and failure[0] is FailureReason.DEADLINE_EXCEEDED:
            end_s = now + deadline_s + extra_s
        else:
            end_s = self.net.network.schedule(self.instance_id, receiver.instance_id if receiver else target, num_bytes, now + control_s / 2)
            end_s += control_s / 2 + extra_s
            if end_s - now > deadline_s and failure is None:
                failure = (FailureReason.DEADLINE_EXCEEDED, f"the transfer took longer than {deadline_s:.3f}s")
                end_s = now + deadline_s
        self.stats.transfers_sent += 1
        self.stats.bytes_sent += num_bytes
        if kill is not None:
            self._loop.call_at(now + (end_s - now) / 2, kill.kill)
        done = self._at(end_s, self._transfer_done, request, receiver, transfer_id, target_request_id, num_bytes, now, failure)

        def cancel(detail: str) -> None:  # it returns at once (the real sender's, an Abort later)
            done.cancel()
            self._transfer_done(request, receiver, transfer_id, target_request_id, num_bytes, now, (FailureReason.CANCELLED, detail))

        assert request.cancel_push is None, "a push started beside one in flight (cancel it first)"
        request.cancel_push = cancel

    @staticmethod
    def _cancel_push(request: SimRequest, detail: str) -> None:
        """Cancel the request's push in flight, if any (worker/instance.py _cancel_pushes)."""
        if request.cancel_push is not None:
            request.cancel_push(detail)

    def _draw_faults(
        self, faults: FaultInjector, transfer_id: str, request_id: str, receiver: HandoverSide | None, num_blocks: int, deadline_s: float
    ) -> tuple[tuple[FailureReason, str] | None, HandoverSide | None, float]:
        """The fault plan's draws for this transfer, as the real sender and receiver make them."""
        sender_faults = faults.begin_transfer(FaultSide.SENDER, transfer_id, request_id)
        receiver_faults = faults.begin_transfer(FaultSide.RECEIVER, transfer_id, request_id)
        if receiver_faults.refuse():
            return (FailureReason.RESOURCE_EXHAUSTED, "Prepare refused (fault plan)"), None, 0.0
        delay_s = 0.0
        for sequence in range(max(1, -(-num_blocks // BLOCKS_PER_CHUNK))):
            for side, drawn in ((self, sender_faults.on_chunk(sequence)), (receiver, receiver_faults.on_chunk(sequence))):
                if not drawn.any:
                    continue
                delay_s += drawn.delay_s
                if drawn.kill:
                    return (FailureReason.PEER_UNAVAILABLE, "a peer was killed (fault plan)"), side, delay_s
                for flag, reason in (
                    ("corrupt", FailureReason.CHECKSUM_MISMATCH), ("drop", FailureReason.INCOMPLETE),
                    ("truncate", FailureReason.INCOMPLETE), ("close", FailureReason.PEER_UNAVAILABLE),
                    ("expire", FailureReason.RESERVATION_EXPIRED),
                ):
                    if getattr(drawn, flag):
                        return (reason, f"{flag} (fault plan)"), None, delay_s
                if drawn.stall:
                    return (FailureReason.DEADLINE_EXCEEDED, "stalled (fault plan)"), None, drawn.stall_extra_s
        return None, None, delay_s

    def _transfer_done(
        self,
        request: SimRequest,
        receiver: HandoverSide | None,
        transfer_id: str,
        target_request_id: str,
        num_bytes: int,
        started_s: float,
        failure: tuple[FailureReason, str] | None,
    ) -> None:
        elapsed_s = self._now() - started_s
        if failure is None and (receiver is None or receiver.dead or not receiver._receive(transfer_id, target_request_id)):
            failure = (FailureReason.UNKNOWN_TRANSFER, f"{transfer_id} is not open on the receiver")
        elif failure is not None and receiver is not None and not receiver.dead:
            receiver._transfer_failed(transfer_id, target_request_id, failure)
        request.cancel_push = None
        rid = request.submit.request_id
        if failure is None:
            self._pushes.append(PushResult(rid, transfer_id, True, None, "", num_bytes, elapsed_s))
        else:
            self.stats.transfers_failed += 1
            self._pushes.append(PushResult(rid, transfer_id, False, failure[0].value, failure[1], 0, elapsed_s))
        if not request.finished:
            if failure is None:
                self._finish(request, S.DISAGG_CONTEXT_COMPLETE, None, None, handed_over=True)
            else:
                self._event(rid, request.llm.state, f"push failed: {failure[0].value}: {failure[1]}")
        self._after_change()

    def _receive(self, transfer_id: str, request_id: str) -> bool:
        """The KV of a reservation committed: the request generates from the next step."""
        request = self._requests.get(request_id)
        if request is None or request.finished or request.transfer_id != transfer_id:
            return False
        if request.llm.state is not S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
            return False
        llm = request.llm
        if request.expiry is not None:
            request.expiry.cancel()
            request.expiry = None
        llm.set_state(S.DISAGG_GENERATION_TRANS_COMPLETE)
        llm.context_current_position = llm.prompt_len
        if request.submit.token_with_kv:
            # An early reservation: the first token comes with the commit (a function of the
            # position here, as every simulated token is).
            llm.add_new_token(instant_token(request.seed, request.num_outputs, self.vocab_size))
            request.num_outputs += 1
        else:
            llm.add_new_token(request.submit.output_token_ids[-1])  # the first token, from the prefill instance
        self._hold_event(request_id, llm.state, "KV received")  # out with the step taking it up
        if self.config.enable_prefix_reuse:
            self.blocks.store_context_blocks(llm)
        self._after_change()
        return True

    def _transfer_failed(self, transfer_id: str, request_id: str, failure: tuple[FailureReason, str]) -> None:
        request = self._requests.get(request_id)
        if request is None or request.finished or request.transfer_id != transfer_id:
            return
        error = RequestError(ErrorCode.TRANSFER_FAILED, failure[1], failure[0].value)
        self._finish(request, S.DISAGG_TRANS_ERROR, 0, FinishReason.ERROR, error=error)
        self._after_change()
