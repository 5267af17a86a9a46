"""Filling a key: re-check the store, take the fleet's lease, generate on the lane, store.

A fill runs in a task owned by `Flights`, never by a request, so a client that leaves
stops only its own reading. The record is stored only if the generation finished normally
and under the producer it was keyed for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from cacheproxy import __version__
from cacheproxy.errors import GenerationTimeout
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.runners.base import Prefill, Runner
from cacheproxy.service.fleet import Fleet
from cacheproxy.service.flights import Fill, Flight
from cacheproxy.service.storage import StoreAccess


@dataclass(frozen=True, slots=True, kw_only=True)
class FillOrder:
    """What one fill is to do."""

    request: CanonicalRequest
    fingerprint: str  # the digest it was keyed under
    store: bool  # store the answer when it may be stored
    recheck: bool  # look in the store first (a shared fill: another may just have stored it)
    previous: codec.Record | None = None  # the stored answer a regeneration replaces
    reuse_scope: str = ""  # whose saved states (prefixes, grammars) the generation may reuse


class Filler:
    """Builds the fill of a key for `Flights`."""

    def __init__(self, runner: Runner, storage: StoreAccess, fleet: Fleet | None, *,
                 generation_timeout: float, clock: Callable[[], float] = time.time) -> None:
        self._runner = runner
        self._storage = storage
        self._fleet = fleet
        self._timeout = generation_timeout
        self._clock = clock

    def fill(self, order: FillOrder) -> Fill:
        """The fill for `order`."""
        storage = self._storage

        async def fill(flight: Flight) -> None:
            key = flight.key
            if order.recheck and (found := await storage.recheck(key, order.request)):
                replay(flight, found)  # filled by a flight that ended between lookup and join
                return
            lease = None
            # A regeneration (previous set) must not be answered by the record it replaces.
            if order.store and self._fleet is not None and order.previous is None:
                got = await self._fleet.lead_or_follow(
                    key, lambda: storage.recheck(key, order.request))
                if isinstance(got, codec.Record):  # another replica generated it
                    flight.remote = True
                    replay(flight, got)
                    return
                lease = got
            try:
                await self._generate(flight, order)
            finally:
                if lease is not None:
                    await lease.release()

        return fill

    async def _generate(self, flight: Flight, order: FillOrder) -> None:
        """Run the generation on the lane, publish it live, store it if it may be stored."""
        started = time.monotonic()
        generation = self._runner.generate(order.request, reuse_scope=order.reuse_scope)
        generation.on_prefill = flight.prefilled
        flight.live.when(generation.live.start)
        try:
            async with asyncio.timeout(self._timeout):
                output = await generation.relay(flight.publish)
        except TimeoutError:
            generation.cancel()
            raise GenerationTimeout(f"generation exceeded {self._timeout:g} s") from None
        except asyncio.CancelledError:
            generation.cancel()
            raise
        flight.generation_ms = (time.monotonic() - started) * 1000
        if order.previous is not None:
            same = codec.same_answer(order.previous.output, output)
            flight.revalidated = "match" if same else "mismatch"
        # Stored only under the producer it was keyed for: the model that ran it (a reload
        # between the key and the lane) and the one serving now (a change meanwhile).
        ran_on = generation.produced_by
        unchanged = self._runner.fingerprint().digest == order.fingerprint and \
            ran_on in (None, order.fingerprint)
        if order.store and unchanged and output.finish_reason in codec.FINISHED:
            flight.not_stored = await self._storage.put(
                flight.key, self._record(order.request, output, flight.generation_ms, flight))
        flight.finish(output)

    def _record(self, request: CanonicalRequest, output: codec.Output, ms: float,
                flight: Flight) -> codec.Record:
        provenance = record_provenance(self._runner.fingerprint(), output,
                                       created_at=self._clock(), generation_ms=ms,
                                       prefill=flight.prefill)
        return codec.Record(request=request.wire(), output=output, provenance=provenance)


def record_provenance(fp: Fingerprint, output: codec.Output, *, created_at: float,
                      generation_ms: float, prefill: Prefill | None) -> dict[str, object]:
    """The provenance of a generated answer (a fill's; a rewritten cassette's)."""
    provenance: dict[str, object] = {
        "fingerprint": fp.digest,
        "fingerprint_fields": fp.fields(),
        "created_at": created_at,
        "generation_ms": round(generation_ms, 3),
        "proxy_version": __version__,
        "lane": f"{_batch(fp.decode_slots)}, cold prefill",
    }
    if prefill is not None and prefill.reused:
        # Bit-identical to cold: continued from a state saved at a multiple of the step.
        provenance["lane"] = f"{_batch(fp.decode_slots)}, aligned prefill"
        provenance["prefill"] = {"reused": prefill.reused, "total": prefill.total}
    if output.margin is not None:
        provenance["margin"] = output.margin.wire()
    return provenance


def _batch(slots: int) -> str:
    """How the answer was decoded: alone, or in a batch pinned at `slots` rows."""
    return "batch-of-one" if slots == 1 else f"pinned batch of {slots}"


def replay(flight: Flight, record: codec.Record) -> None:
    """Publish a stored answer on a flight, chunk by chunk, as it was generated."""
    flight.created_at = float(record.provenance.get("created_at", 0.0))
    for chunk in record.output.chunks:
        flight.publish(chunk)
    flight.finish(record.output, from_store=True)
