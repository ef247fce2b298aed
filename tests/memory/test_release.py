"""The heap frozen after start-up (no collector pauses over it), thawed when memory is given back so an
unloaded model's cycles still go."""

import gc
import weakref

import pytest

from mlxhost.memory.release import freeze_heap, give_back_memory


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def thawed_after():
    yield
    gc.unfreeze()


def test_freeze_takes_the_heap_out_of_collections(thawed_after):
    freeze_heap()
    assert gc.get_freeze_count() > 0
    node = Node()
    ref = weakref.ref(node)
    del node
    gc.collect()
    assert ref() is None  # objects made after the freeze are collected as usual


def test_giving_memory_back_collects_frozen_cycles_and_freezes_again(thawed_after):
    node = Node()
    ref = weakref.ref(node)
    freeze_heap()  # the node is part of the frozen start-up heap now
    del node
    gc.collect()
    assert ref() is not None  # a plain collection leaves frozen objects alone
    give_back_memory()  # e.g. after a model unload
    assert ref() is None
    assert gc.get_freeze_count() > 0
