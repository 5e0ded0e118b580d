"""An instant instance: speaks the real router/instance protocol (worker/protocol.py) and answers at
once, with no model, no engine thread and no KV bytes. A fixture for tests and benchmarks of
everything above the instance: the router (bench/router_bench.py), the front ends.

What it does, per request type, the moment a request is submitted:
- CONTEXT_ONLY: "prefill started", then the first token with `context_done`; it holds the (pretend)
  KV until a Push command, which it delivers to the target instance at once (same process, found
  by transfer address in an `InstantNetwork`), then reports the push ok and ends the hop as
  handed over.
- GENERATION_ONLY: reserves at once (a ReservationNotice with a fresh transfer id); when the KV
  arrives it reports DISAGG_GENERATION_TRANS_COMPLETE and every remaining token, finished.
- CONTEXT_AND_GENERATION: every token at once, finished.
Tokens are a pure function of (seed, output position), as the real sampler's random stream is
keyed, so a request gives the same tokens colocated, disaggregated or recovered. It reports its
prompts' full blocks as prefix-cache events, so KV-aware placement has something to read.

`handle(bytes) -> bytes` is the same entry point as worker/instance.py's; a poll never waits here
(the caller waits for `has_mail` itself: cluster/router/instance_client.py's InstantInstanceClient).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.block_hash import PrefixEvent, PrefixEventKind, block_hash_chain
from scheduler.state import LlmRequestState
from worker.kv_layout import KvLayout
from worker.kv_transfer.ids import new_transfer_id
from worker.protocol import (
    EVENT_PREFILL_STARTED,
    Abort,
    Ack,
    Decoder,
    Drain,
    Drained,
    Encoder,
    EngineLoad,
    ErrorCode,
    GetInfo,
    InstanceInfo,
    InstanceRole,
    Ping,
    Poll,
    PollBatch,
    Pong,
    Push,
    PushResult,
    Rejected,
    Release,
    Renew,
    RequestError,
    RequestOutput,
    RequestType,
    ReservationNotice,
    StateEvent,
    Submit,
    SubmitRequest,
    Unavailable,
)
from worker.protocol import Command as CommandType
from worker.stopping import FinishReason

INSTANT_LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="instant")


def instant_token(seed: int, position: int, vocab_size: int) -> int:
    """The token an instant instance emits at output `position` of a request seeded `seed`."""
    return (seed * 1_000_003 + position * 7_919 + 17) % vocab_size


class InstantNetwork:
    """The instant instances of one process, by transfer address (where a Push delivers)."""

    def __init__(self) -> None:
        self.by_address: dict[str, InstantInstance] = {}
        self._ports = itertools.count(1)

    def address(self) -> str:
        return f"instant:{next(self._ports)}"


@dataclass
class _Request:
    submit: SubmitRequest
    transfer_id: str | None = None  # GENERATION_ONLY: its reservation
    context_done: bool = False


@dataclass
class _Mail:
    outputs: list[RequestOutput] = field(default_factory=list)
    events: list[StateEvent] = field(default_factory=list)
    reservations: list[ReservationNotice] = field(default_factory=list)
    push_results: list[PushResult] = field(default_factory=list)
    prefix_events: list[PrefixEvent] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outputs or self.events or self.reservations or self.push_results or self.prefix_events)


class InstantInstance:
    def __init__(
        self,
        instance_id: str,
        role: InstanceRole,
        network: InstantNetwork,
        *,
        num_blocks: int = 4096,
        vocab_size: int = 264,
        max_seq_len: int = 4096,
        layout: KvLayout = INSTANT_LAYOUT,
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.network = network
        self.address = network.address()
        network.by_address[self.address] = self
        self.info = InstanceInfo(
            instance_id, role, f"instant-{instance_id}", self.address, layout, num_blocks, vocab_size, max_seq_len, 0, "none"
        )
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._by_transfer: dict[str, str] = {}
        self._mail = _Mail()
        self._sequence = 0
        self._encoder = Encoder()
        self._decoder: Decoder[CommandType] = Decoder(CommandType)
        self.on_mail: Callable[[], None] | None = None  # called when mail arrives (the client's wake-up)
        self.draining = False

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def has_mail(self) -> bool:
        return bool(self._mail)

    # --- the protocol entry point -------------------------------------------------------------------
    def handle(self, payload: bytes) -> bytes:
        return self._encoder.encode(self.execute(self._decoder.decode(payload)))

    def execute(self, command: CommandType):
        match command:
            case Submit():
                return self._submit(command.request)
            case Abort():
                self._end(command.request_id, RequestError(ErrorCode.ABORTED, command.detail))
                return Ack()
            case Release():
                self._end(command.request_id, RequestError(ErrorCode.TRANSFER_FAILED, command.detail, command.reason.name))
                return Ack()
            case Push():
                self._push(command)
                return Ack()
            case Renew():
                return Ack()  # its reservations never expire
            case Poll():
                return self._poll()
            case GetInfo():
                return self.info
            case Ping():
                return Pong(self.info.incarnation)
            case Drain():
                self.draining = True
                return Drained(len(self._requests))
        return Unavailable(f"an instant instance does not serve {type(command).__name__}")

    # --- requests -----------------------------------------------------------------------------------
    def _submit(self, submit: SubmitRequest):
        if self.draining:
            return Unavailable("draining")
        if submit.request_id in self._requests:
            return Rejected("request_id", f"{submit.request_id!r} is already here")
        request = _Request(submit)
        self._requests[submit.request_id] = request
        now = self._clock()
        kind = submit.request_type
        if kind is RequestType.GENERATION_ONLY:
            request.transfer_id = new_transfer_id()
            self._by_transfer[request.transfer_id] = submit.request_id
            blocks = -(-len(submit.context_token_ids) // self.info.layout.tokens_per_block)
            self._mail.reservations.append(ReservationNotice(submit.request_id, request.transfer_id, blocks, now + 60.0, 60.0))
        else:
            self._mail.events.append(StateEvent(submit.request_id, LlmRequestState.CONTEXT_INIT, now, EVENT_PREFILL_STARTED))
            self._store_prefix(submit)
            if kind is RequestType.CONTEXT_ONLY:
                request.context_done = True
                first = self._token(submit, len(submit.output_token_ids))
                finished = len(submit.output_token_ids) + 1 >= submit.sampling_params.max_tokens
                self._output(submit, (first,), context_done=not finished, finished=finished)
                if finished:
                    del self._requests[submit.request_id]
            else:
                self._generate_rest(submit, len(submit.output_token_ids))
        self._wake()
        return Ack()

    def _push(self, push: Push) -> None:
        request = self._requests.get(push.request_id)
        target = self.network.by_address.get(push.target)
        ok = request is not None and target is not None and target._receive(push.transfer_id, push.target_request_id or push.request_id)
        self._mail.push_results.append(
            PushResult(push.request_id, push.transfer_id, ok, None if ok else "PEER_UNAVAILABLE", "" if ok else "no such transfer", 0, 0.0)
        )
        if ok and request is not None:
            del self._requests[push.request_id]
            self._mail.outputs.append(RequestOutput(push.request_id, (), "", finished=True, handed_over=True))
        self._wake()

    def _receive(self, transfer_id: str, request_id: str) -> bool:
        """The KV of a reservation arrived: commit, then generate the rest."""
        if self._by_transfer.get(transfer_id) != request_id or request_id not in self._requests:
            return False
        del self._by_transfer[transfer_id]
        submit = self._requests[request_id].submit
        self._mail.events.append(StateEvent(request_id, LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE, self._clock(), "KV received"))
        # An early reservation's first token came with the KV (it is a function of the position).
        self._generate_rest(submit, len(submit.output_token_ids) + (1 if submit.token_with_kv else 0))
        self._wake()
        return True

    def _generate_rest(self, submit: SubmitRequest, start: int) -> None:
        tokens = tuple(self._token(submit, position) for position in range(start, submit.sampling_params.max_tokens))
        self._output(submit, tokens, finished=True)
        self._requests.pop(submit.request_id, None)

    def _end(self, request_id: str, error: RequestError) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.transfer_id is not None:
            self._by_transfer.pop(request.transfer_id, None)
        self._mail.outputs.append(RequestOutput(request_id, (), "", finished=True, error=error))
        self._wake()

    def _output(self, submit: SubmitRequest, tokens: tuple[int, ...], *, finished: bool, context_done: bool = False) -> None:
        self._mail.outputs.append(
            RequestOutput(
                submit.request_id,
                tokens,
                "",
                finished=finished,
                finish_reason=FinishReason.LENGTH if finished else None,
                context_done=context_done,
                num_prompt_tokens=len(submit.prompt_token_ids),
                num_output_tokens=len(submit.output_token_ids) + len(tokens),
            )
        )

    def _token(self, submit: SubmitRequest, position: int) -> int:
        seed = submit.sampling_params.seed or 0
        return instant_token(seed, position, self.info.vocab_size)

    def _store_prefix(self, submit: SubmitRequest) -> None:
        tpb = self.info.layout.tokens_per_block
        for block_hash in block_hash_chain(submit.context_token_ids, tpb):
            self._mail.prefix_events.append(PrefixEvent(PrefixEventKind.STORED, block_hash))

    def remember_blocks(self, block_hashes) -> None:
        """Report these blocks as held in the prefix cache (a benchmark's or test's starting state)."""
        self._mail.prefix_events.extend(PrefixEvent(PrefixEventKind.STORED, h) for h in block_hashes)
        self._wake()

    # --- mail ---------------------------------------------------------------------------------------
    def _poll(self) -> PollBatch:
        mail, self._mail = self._mail, _Mail()
        self._sequence += 1
        busy = len(self._requests)
        load = EngineLoad(
            self.info.role,
            self.info.num_blocks,
            self.info.num_blocks,
            self.info.layout.tokens_per_block,
            running_requests=busy,
            prefix_events=tuple(mail.prefix_events),
        )
        return PollBatch(
            self.info.incarnation,
            self._sequence,
            tuple(mail.outputs),
            tuple(mail.events),
            tuple(mail.reservations),
            tuple(mail.push_results),
            load,
        )

    def _wake(self) -> None:
        if self.on_mail is not None:
            self.on_mail()
