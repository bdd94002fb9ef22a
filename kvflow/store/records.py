"""The master's records: clients, their segments, replicas and objects
(model.py keeps them; repair.py and ssd_model.py work on them too), and
what makes a key valid."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from .allocator import Allocator
from .errors import InvalidKeyError

__all__ = ["State", "Client", "Segment", "Replica", "Object", "Recovered", "restored_class", "entry_pins", "check_key",
           "plain_keys", "namespace_of", "MAX_KEY_BYTES", "NS_SEP"]

MAX_KEY_BYTES = 4096
# A namespaced key, as clients with a namespace send it: "<namespace>\x1f<key>"
# (StoreClient(namespace=...) adds the prefix; users' keys may not hold it)
NS_SEP = "\x1f"


def namespace_of(key: str) -> str:
    """The namespace of a key as the master sees it ("" for none)."""
    i = key.find(NS_SEP)
    return key[:i] if i > 0 else ""


def check_key(key: object) -> str:
    if not isinstance(key, str):
        raise InvalidKeyError(f"a key must be a str, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("a key must not be empty")
    if len(key) > MAX_KEY_BYTES // 4 and len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"a key must be at most {MAX_KEY_BYTES} UTF-8 bytes", key=key[:64])
    return key


def plain_keys(keys: list, *, user: bool = False) -> bool:
    """Whether every one of `keys` is a valid key that needs no per-key
    check: a non-empty str of at most MAX_KEY_BYTES // 4 characters (so at
    most MAX_KEY_BYTES in UTF-8), and, for `user` keys (before a client's
    namespace prefix), without NS_SEP. False sends the caller to the per-key
    path, which names what is wrong. The servers ask batch_exists before
    every put and get, and both ends of it check its keys, so this runs in
    C: one join (TypeError unless every key is a str), all() (no empty
    str), and the lengths only when the keys together are longer than one
    key may be (about 2x faster than a set of types and a list of lengths
    for 128 keys)."""
    if not keys:
        return True
    try:
        joined = "".join(keys)
    except TypeError:
        return False
    if not all(keys):
        return False
    if len(joined) > _PLAIN_CHARS and max(map(len, keys)) > _PLAIN_CHARS:
        return False
    return not user or NS_SEP not in joined


_PLAIN_CHARS = MAX_KEY_BYTES // 4


class State(enum.Enum):
    ALLOCATED = "allocated"     # space reserved, the writer is writing; invisible
    COMPLETE = "complete"       # written and committed; readable


@dataclass(eq=False)
class Client:
    id: str
    host: str
    engine: str                 # its kvflow engine's address (peers connect there)
    last_seen: float
    segments: set[int] = field(default_factory=set)
    writing: set[str] = field(default_factory=set)     # keys it has put_start'ed, not ended
    repairing: set[str] = field(default_factory=set)   # keys it is copying a new replica of
    beat_token: str = ""        # proves a heartbeat from the client's own thread is its
    recovered: bool = False     # restored from etcd: no session yet (its owner may register again)
    ssd_dir: str = ""           # its SSD tier's directory ("" none; ssd_tier.py)
    ssd_mode: str = ""          # "evict" or "eager"
    ssd_keys: set[str] = field(default_factory=set)    # objects it holds an SSD copy of
    ssd_pending: dict[str, None] = field(default_factory=dict)  # "eager": landed in its segment, not copied yet
    window: float = 0.0         # its write window (fence.py), as it said at register


@dataclass(eq=False)
class Segment:
    id: int
    client: str
    name: str
    base: int                   # the region's address in the holder's process
    size: int
    alloc: Allocator
    keys: set[str] = field(default_factory=set)       # objects with a replica here
    attached: bool = True       # False: restored from etcd, its owner has not mounted it again

    def fits(self, size: int) -> bool:
        return self.alloc.fits(size)

    def fill_after(self, size: int) -> float:
        return (self.alloc.used + size) / self.alloc.capacity


@dataclass(eq=False, slots=True)
class Replica:
    segment: int
    offset: int
    length: int                 # the allocation's length (the object's size, rounded up)


@dataclass(eq=False)
class Object:
    key: str
    size: int
    replicas: list[Replica]
    state: State
    writer: str
    pinned: bool = False
    soft_until: float = 0.0     # soft pin: evicted only when nothing else can go, until this time
    want: int = 1               # the replicas its put asked for: lost ones are made again (repair_start)
    token: int = 0              # the writer's put call, so a revoke undoes only its own call's puts
    ssd: set[str] | None = None     # clients holding an SSD copy (ssd_agent.py); None: none
    promoting: list[Replica] | None = None  # DRAM space allocated by a promotion in progress
    ssd_declined: set[str] | None = None    # clients whose tier let its copy go (not offered again)
    # read leases on it: lease id -> until (one id per get call; a reader
    # that finished releases its id, the others run out by time)
    leases: dict[int, float] = field(default_factory=dict)

    def leased(self, now: float) -> bool:
        if not self.leases:
            return False
        for until in self.leases.values():
            if until > now:
                return True
        self.leases.clear()
        return False

    def lease_end(self) -> float:
        return max(self.leases.values(), default=0.0)


class Recovered(Object):
    """An Object recovered from etcd and not yet touched: made whole from its
    record's entry ([key, size, [[segment, offset, length], ...], pinned,
    writer, token, want?, soft_until?], durable.py) at the first read or
    write of any attribute, when it becomes a plain Object (its class
    swapped, the same instance: dicts and sets holding it stay valid).
    A recovery makes a million of these with one C-level call and serves
    at once instead of spending ~2 us per object building Objects and
    Replicas most of which no call will look at soon. Until then nothing
    about the object can change without touching it, so the record is its
    state. Each recovery makes a subclass of its own (restored_class)
    that holds each instance's place in its records (`places`), what
    makes that place an entry (`entry`), its model's clock at the
    recovery (`now`) and the wall clock then (soft pins' deadlines)."""
    __slots__ = ()
    places: dict = {}
    entry = staticmethod(lambda place: place)
    now = 0.0
    wall = 0.0

    def __getattribute__(self, name: str):
        _materialise(self)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value) -> None:
        _materialise(self)
        object.__setattr__(self, name, value)


def restored_class(places: dict, entry: Callable[[Any], list], now: float, wall: float) -> type[Recovered]:
    cls = type("Recovered", (Recovered,), {"__slots__": (), "places": places, "entry": staticmethod(entry),
                                           "now": now, "wall": wall})
    # an instance's attributes live in a values array sized by its class's
    # shared keys when it was made: one instance given every field, in
    # Object.__init__'s order, makes the others' room for all of them (an
    # object made whole held a full dict otherwise: 780 B an object, not 380)
    proto = object.__new__(cls)
    for f in fields(Object):
        object.__setattr__(proto, f.name, None)
    return cls


def entry_pins(e: list, now: float, wall: float) -> tuple[int | None, float]:
    """A recorded entry's want (None: a record from before want) and its
    soft pin's end on the model's clock (`now` then, `wall` the wall clock
    then; 0.0: none, or a deadline already past)."""
    want = e[6] if len(e) > 6 else None
    deadline = e[7] if len(e) > 7 else 0
    return want, (float(now + deadline - wall) if deadline and deadline > wall else 0.0)


def _materialise(obj: Recovered) -> None:
    cls = type(obj)
    e = cls.entry(cls.places.pop(obj))
    if not cls.places:
        cls.entry = None            # every one made: the records' columns can go
    object.__setattr__(obj, "__class__", Object)
    key, size, replicas, pinned, writer, token = e[:6]
    want, soft_until = entry_pins(e, cls.now, cls.wall)
    Object.__init__(obj, key, size, [Replica(s, o, n) for s, o, n in replicas], State.COMPLETE, writer,
                    pinned=bool(pinned), token=token, want=len(replicas) if want is None else max(1, int(want)),
                    soft_until=soft_until)
