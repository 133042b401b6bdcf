"""criu images restore only as the job's user: the credentials in crafted core images (criu's
layout: header, length, CoreEntry.thread_core.creds) are read, and images naming another user,
another group, capabilities, or nothing readable are refused with a clear error."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from criu_hooks import image_owner
from criu_hooks.image_owner import ImageRefused

USER, GROUP = 1000, 1000


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def core_image(*, uid: int = USER, gid: int = GROUP, euid: int | None = None, groups: tuple[int, ...] = (),
               caps: int = 0) -> bytes:
    """A core image as criu writes it, with only the fields the check reads plus one it skips."""
    ids = [uid, gid, uid if euid is None else euid, gid, uid, gid, uid, gid]
    creds = b"".join(_field(i + 1, v) for i, v in enumerate(ids))
    creds += b"".join(_field(10, c) for c in (caps, 0)) + b"".join(_field(14, g) for g in groups)
    thread_core = _field(1, 0) + _field(2, 24) + _field(10, creds)
    entry = _field(1, 1) + _field(3, _field(1, 7)) + _field(5, thread_core)
    return b"\x19\x43\x56\x54\x47\x38\x05\x55" + struct.pack("<I", len(entry)) + entry


def write(tmp_path: Path, *images: bytes) -> Path:
    for i, data in enumerate(images):
        (tmp_path / f"core-{100 + i}.img").write_bytes(data)
    return tmp_path


def test_the_job_users_own_images_pass(tmp_path: Path) -> None:
    images = write(tmp_path, core_image(groups=(GROUP, 27)), core_image())
    image_owner.check(images, uid=USER, gids={GROUP, 27})
    assert [t.uids for t in image_owner.read(images)] == [{USER}, {USER}]


def test_images_of_another_user_or_root_are_refused(tmp_path: Path) -> None:
    images = write(tmp_path, core_image(), core_image(uid=0, gid=0))
    with pytest.raises(ImageRefused, match=r"core-101.img as uid \[0\], not as the job's user \(uid 1000\)"):
        image_owner.check(images, uid=USER, gids={GROUP})


def test_one_set_id_that_differs_is_enough_to_refuse(tmp_path: Path) -> None:
    with pytest.raises(ImageRefused, match=r"as uid \[0, 1000\]"):
        image_owner.check(write(tmp_path, core_image(euid=0)), uid=USER, gids={GROUP})


def test_a_group_the_user_is_not_in_or_capabilities_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageRefused, match=r"in groups \[0\]"):
        image_owner.check(write(tmp_path, core_image(groups=(0,))), uid=USER, gids={GROUP})
    with pytest.raises(ImageRefused, match="with capabilities"):
        image_owner.check(write(tmp_path, core_image(caps=1 << 21)), uid=USER, gids={GROUP})


def test_root_jobs_images_may_hold_anything_root_holds(tmp_path: Path) -> None:
    image_owner.check(write(tmp_path, core_image(uid=0, gid=0, groups=(0, 1), caps=0xFFFFFFFF)), uid=0, gids={0})


@pytest.mark.parametrize("damage", ["empty", "short header", "huge length", "cut", "garbage", "no creds"])
def test_damaged_images_are_refused_not_crashed_on(tmp_path: Path, damage: str) -> None:
    good = core_image()
    data = {"empty": b"", "short header": good[:10], "huge length": good[:8] + struct.pack("<I", 1 << 30) + good[12:],
            "cut": good[:-5], "garbage": good[:12] + b"\xff" * (len(good) - 12),
            "no creds": good[:8] + struct.pack("<I", 2) + _field(1, 1)}[damage]
    with pytest.raises(ImageRefused):
        image_owner.check(write(tmp_path, data), uid=USER, gids={GROUP})


def test_no_task_images_at_all_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageRefused, match="no task images"):
        image_owner.check(tmp_path, uid=USER, gids={GROUP})
