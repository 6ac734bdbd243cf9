import gc

from flexmarl.runtime import collector


def test_what_is_set_apart_is_walked_by_no_collection_until_the_block_ends():
    held = [[] for _ in range(1000)]
    with collector.set_apart() as keep:
        keep()
        assert gc.get_freeze_count() >= len(held)
        gc.collect()
        assert gc.get_freeze_count() >= len(held)  # a full collection leaves them apart
    assert gc.get_freeze_count() == 0


def test_objects_frozen_before_the_block_are_left_to_whoever_froze_them():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector.set_apart() as keep:
            keep()
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
