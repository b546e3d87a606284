"""Keys are bytes: a key that is not UTF-8 (``\\xff``, an encoded surrogate) or
holds a NUL goes through every command, and is shown with each undecodable
byte or unprintable character as ``\\xNN`` (``format.fb_roots.shown``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _procs import SAFETY_S

import ptdstream
from ptdstream.cli import main
from ptdstream.format.fb_roots import shown

ROOT = os.path.dirname(os.path.dirname(ptdstream.__file__))  # the ptdstream the subprocesses run
#: Placeholder key -> the bytes it is patched to (same length), and its value.
KEYS = {b"kAAk": (b"k\xff\xfek", b"1234abcd"), b"kBBk": (b"\xed\xa0\x80k", b"zzzz"), b"kCCk": (b"k\x00zk", b"qqqqqqqq")}


@pytest.fixture
def ptd(tmp_path):
    """A .ptd whose three keys are the patched bytes of KEYS."""
    from ptdstream.format.plan import SavePlan
    from ptdstream.format.ptd import plan_data_files
    from ptdstream.format.pte import PteOptions
    from ptdstream.store import StreamingNamedDataStore
    from ptdstream.write.set_writer import write_save_plan

    store = StreamingNamedDataStore()
    for placeholder, (_, value) in KEYS.items():
        store.add_named_data(placeholder.decode(), value, external_tag="t")
    out = store.get_named_data_store_output()
    write_save_plan(SavePlan(plan_data_files(out.buffers, out.external_data, str(tmp_path),
                                             fingerprints=out.fingerprints), None, PteOptions(), 0))
    data = (tmp_path / "t.ptd").read_bytes()
    for placeholder, (key, _) in KEYS.items():
        assert data.count(placeholder) == 1
        data = data.replace(placeholder, key)
    (tmp_path / "t.ptd").write_bytes(data)
    return tmp_path / "t.ptd"


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_shown_escapes_undecodable_bytes_and_controls_one_way():
    assert shown(b"k\xff\xfek") == shown("k\udcff\udcfek") == "k\\xff\\xfek"
    assert shown(b"\xed\xa0\x80k") == "\\xed\\xa0\\x80k"
    assert shown("k\x00z", quote=True) == "'k\\x00z'"
    assert shown("caf\u00e9 \u4e2d") == "caf\u00e9 \u4e2d"  # valid UTF-8 stays as it is
    assert shown("\ud800") == "\\ud800"  # a surrogate of no byte


def test_inspect_shows_every_key_escaped_and_json_keeps_the_bytes(ptd, capsys):
    code, out, _ = _cli(capsys, "inspect", ptd)
    assert code == 0
    assert "    'k\\xff\\xfek' -> segment 0 (8 bytes)\n" in out
    assert "    '\\xed\\xa0\\x80k' -> segment 1 (4 bytes)\n" in out
    assert "    'k\\x00zk' -> segment 2 (8 bytes)\n" in out
    code, out, _ = _cli(capsys, "inspect", ptd, "--json")
    keys = [k["key"] for k in json.loads(out)["files"][0]["keys"]]
    assert code == 0 and [k.encode("utf-8", "surrogateescape") for k in keys] == [k for k, _ in KEYS.values()]


def test_manifest_is_written_read_and_verified_and_a_bad_key_is_named_escaped(ptd, capsys):
    manifest = ptd.parent / "t.manifest"
    code, out, err = _cli(capsys, "manifest", ptd)
    assert (code, err) == (0, "") and out == f"wrote {manifest}: 1 file(s), 1 piece(s), 3 key(s)\n"
    code, out, _ = _cli(capsys, "verify", ptd, "--manifest", manifest)
    assert code == 0 and out == f"OK {ptd}: matches the manifest (648 bytes, 1 piece)\n"
    data = bytearray(ptd.read_bytes())
    data[data.index(b"1234abcd")] ^= 1
    ptd.write_bytes(data)
    code, out, _ = _cli(capsys, "verify", ptd, "--manifest", manifest)
    assert code == 1 and "keys differing: 'k\\xff\\xfek'" in out and ", key 'k\\xff\\xfek'" in out
    code, out, _ = _cli(capsys, "verify", ptd, "--manifest", manifest, "--json")
    (check,) = json.loads(out)["checks"]
    assert code == 1 and [k.encode("utf-8", "surrogateescape") for k in check["bad_keys"]] == [b"k\xff\xfek"]


def test_verify_names_the_keys_it_resolves(ptd, capsys, tmp_path):
    from _small_exports import write_reference

    pte = write_reference("plain", tmp_path / "p")["model.pte"]
    code, out, _ = _cli(capsys, "verify", pte, ptd)  # a program first: each .ptd after it is checked too
    assert "ok   " + str(ptd) + ": named keys: 3 keys resolve to segments" in out
    assert "ok   " + str(ptd) + ": keys unique: no key repeats" in out


def test_extract_lists_escaped_and_writes_a_key_named_by_its_bytes(ptd, capsys, tmp_path):
    from ptdstream.pack import pack

    pack(str(ptd), str(tmp_path / "t.ptd.zst"))
    code, out, _ = _cli(capsys, "extract", tmp_path / "t.ptd.zst", "--list")
    assert code == 0
    assert "keys: k\\xff\\xfek\n" in out and "keys: \\xed\\xa0\\x80k\n" in out and "keys: k\\x00zk\n" in out
    code, out, _ = _cli(capsys, "extract", tmp_path / "t.ptd.zst", "--list", "--json")
    keys = [k for s in json.loads(out)["segments"] for k in s["keys"]]
    assert [k.encode("utf-8", "surrogateescape") for k in keys] == [k for k, _ in KEYS.values()]
    for key, value in list(KEYS.values())[:2]:  # a NUL cannot be in a command line
        out_file = tmp_path / "key.bin"
        proc = subprocess.run([os.fsencode(sys.executable), b"-m", b"ptdstream", b"extract",
                               os.fsencode(tmp_path / "t.ptd.zst"), key, b"-o", os.fsencode(out_file), b"-f", b"-q"],
                              capture_output=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=SAFETY_S)
        assert proc.returncode == 0, proc.stderr
        assert out_file.read_bytes() == value
