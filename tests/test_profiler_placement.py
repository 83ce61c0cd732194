import gc

import torch

from hf_memo.profiler.placement import location_of, mark_host, mark_owned, owner_of


def test_tags_follow_the_storage_including_views():
    host = mark_host(torch.empty(16))
    owned = mark_owned(torch.empty(8), "layer 0 rounding 1")
    plain = torch.empty(4)
    assert location_of(host[2:5].untyped_storage()) == "host"
    assert location_of(plain.untyped_storage()) == "device"
    assert owner_of(owned.view(2, 4).untyped_storage()) == "layer 0 rounding 1"
    assert owner_of(plain.untyped_storage()) is None


def test_tags_do_not_keep_storages_alive():
    import weakref

    tensor = mark_host(torch.empty(1024))
    ref = weakref.ref(tensor.untyped_storage())
    del tensor
    gc.collect()
    assert ref() is None


def test_watchers_hear_of_every_tag_until_removed():
    from hf_memo.profiler.placement import add_tag_watcher, remove_tag_watcher

    heard = []
    add_tag_watcher(heard.append)
    try:
        host = mark_host(torch.empty(4))
        owned = mark_owned(torch.empty(2), "buffer")
    finally:
        remove_tag_watcher(heard.append)
    mark_host(torch.empty(1))
    assert [s.data_ptr() for s in heard] == [host.data_ptr(), owned.data_ptr()]
