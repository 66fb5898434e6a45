"""What the etcd store accepts of etcd's answers (dxpu_vfio/pool/etcd_answers.py) and of
the records under the pool's prefix (dxpu_vfio/pool/etcd_records.py): every field it
reads is checked once, where the answer arrives, so a wrong endpoint or a record changed
by hand is one clear error, never a KeyError in the middle of an allocation; and with a
real etcd, a bad record names its key and the etcdctl command, and nothing else is lost.
(The answers here are hand-made because they are what real etcd never sends; the real
answers pass through the same checks in every etcd test.)"""

from __future__ import annotations

import base64
import json
import re

import pytest

from dxpu_vfio.pool.etcd_answers import EtcdAnswerError, check, check_events
from dxpu_vfio.pool.etcd_records import BadRecord, check_record
from dxpu_vfio.pool.etcd_client import b64, op_put, op_range
from dxpu_vfio.pool.etcd_store import EtcdStore

P = "/dxpu/v1/"
BOX = {"address": "10.0.0.2:7000", "tls_dir": None, "state": "up", "registered_at": 1.0, "last_error": None,
       "cert_sha256": None, "generation": "g"}


def kv(key: str, value: object = None, **fields: object) -> dict:
    out = {"key": b64(key), "mod_revision": "7", "create_revision": "5", **fields}
    if value is not None:
        out["value"] = b64(json.dumps(value))
    return out


def answer(**fields: object) -> bytes:
    return json.dumps({"header": {"revision": "9"}, **fields}).encode()


RANGE = {"key": b64(P + "boxes/"), "range_end": b64(P + "boxes0")}


def test_a_real_shaped_range_answer_is_parsed_once_with_its_records():
    got = check("/kv/range", answer(kvs=[kv(P + "boxes/a", BOX), kv(P + "boxes/b", BOX)], count="2"), RANGE, P)
    assert [k["record"] for k in got["kvs"]] == [BOX, BOX]


@pytest.mark.parametrize("body, why", [
    (b"<html>502 Bad Gateway</html>", "not JSON"),
    (b"[1, 2]", "the answer: [1, 2] is not an object"),
    (b'{"kvs": []}', "header: None is not an object"),
    (answer(kvs=5), "kvs: 5 is not a list"),
    (json.dumps({"header": {"revision": "x"}}).encode(), "header.revision: 'x' is not a number"),
    (answer(kvs=[{"key": "!!"}]), "kvs[0].key: '!!' is not base64"),
    (answer(kvs=[kv(P + "boxes/a", BOX, mod_revision=[])]), "kvs[0].mod_revision: [] is not a number"),
    (answer(kvs=[kv(P + "boxes/a", BOX)], more="yes"), "more: 'yes' is not true or false"),
    (answer(kvs=[], more=True), "more: true, with no key-values"),
    (answer(kvs=[kv(P + "boxes/b", BOX), kv(P + "boxes/a", BOX)]), "kvs[1].key"),  # not ascending: no progress
    (answer(kvs=[kv(P + "seen/a", 1.0)]), "kvs[0].key"),  # not asked for
])
def test_a_range_answer_that_is_not_etcds_names_the_field(body, why):
    with pytest.raises(EtcdAnswerError) as caught:
        check("/kv/range", body, RANGE, P)
    assert why in str(caught.value)


def test_a_transaction_answer_has_one_response_of_each_operations_kind():
    ops = [op_range(P + "boxes/a"), op_put(P + "seen/a", 1.0)]
    request = {"compare": [], "success": ops, "failure": []}
    good = [{"response_range": {"kvs": [kv(P + "boxes/a", BOX)]}}, {"response_put": {}}]
    assert check("/kv/txn", answer(succeeded=True, responses=good), request, P)["responses"][0]
    for responses, why in (([good[0]], "1 for 2 operations"), ([good[1], good[0]], "no response_range"),
                           ([{"response_range": {"kvs": [kv(P + "boxes/b", BOX)]}}, good[1]], "kvs[0].key")):
        with pytest.raises(EtcdAnswerError, match=re.escape(why)):
            check("/kv/txn", answer(succeeded=True, responses=responses), request, P)
    with pytest.raises(EtcdAnswerError, match="0 for 2"):  # the failure branch is empty
        check("/kv/txn", answer(succeeded=True), request, P)
    assert check("/kv/txn", answer(succeeded=False), request, P)  # and it is what ran


@pytest.mark.parametrize("key, value, why", [
    (P + "boxes/a", {**BOX, "state": "sideways"}, "'state' = 'sideways'"),
    (P + "boxes/a", 5, "holds int, not an object"),
    (P + "boxes/a", {k: v for k, v in BOX.items() if k != "address"}, "lacks its 'address' field"),
    (P + "inventory/a", [{"name": "d0", "class": "nvme", "vendor": "1b36", "model": "x"}], "device 0 lacks"),
    (P + "leases/L1", {"id": "L1", "device": "a/d0", "vm": "v", "state": "attached", "qdev_id": "q", "x": 1},
     "fields dxpu does not write: x"),
    (P + "leases/L1", {"id": "L1", "device": "nobox", "vm": "v", "state": "attached", "qdev_id": "q"},
     "'device' = 'nobox'"),
    (P + "claims/a", "L1", "is not claims/<name>/<name>"),
    (P + "boxes/", BOX, "is not boxes/<name>"),
    (P + "schema", None, "not a version number"),
    ("/elsewhere/boxes/a", BOX, "outside the pool's prefix"),
])
def test_a_record_of_another_shape_is_a_bad_record_naming_its_key(key, value, why):
    with pytest.raises(BadRecord) as caught:
        check_record(P, key, value)
    assert why in str(caught.value) and caught.value.key == key and f"etcdctl get {key}" in caught.value.hint


def test_a_value_that_is_not_json_is_a_bad_record_and_a_delete_carries_none():
    with pytest.raises(BadRecord, match="not JSON"):
        check("/kv/range", answer(kvs=[{"key": b64(P + "boxes/a"), "value": b64("{oops")}]), RANGE, P)
    events = check_events([{"type": "DELETE", "kv": {"key": b64(P + "boxes/a")}}], P)
    assert events[0]["kv"]["record"] is None
    with pytest.raises(EtcdAnswerError, match="neither PUT nor DELETE"):
        check_events([{"type": "MOVE", "kv": kv(P + "boxes/a", BOX)}], P)


def test_a_record_changed_by_hand_is_named_and_nothing_else_is_lost(etcd, etcd_prefix, tmp_path):
    """Real etcd: a box record overwritten with other JSON (as ``etcdctl put`` would)
    makes the listing and allocation (which read every box) fail with the key and the
    command, not guess around it; nothing else is lost: once the key is deleted (the
    hint's command) both work on the rest of the pool."""
    store = EtcdStore(etcd.endpoints, path=tmp_path / "pool.db", prefix=etcd_prefix)
    try:
        for name in ("a", "b"):
            store.register_box(name, f"10.0.0.{len(name)}:7000", None,
                               [{"id": "d0", "class": "testdev", "vendor": "1b36", "model": "10f0", "capacity": 1}])
        bad = etcd_prefix + "boxes/b"
        store.etcd.txn([], [op_put(bad, {"address": 7})])
        for call in (store.boxes, lambda: store.allocate("vm1", box="a")):
            with pytest.raises(BadRecord) as caught:
                call()
            assert caught.value.key == bad and f"etcdctl del {bad}" in caught.value.hint
        store.etcd.call("/kv/deleterange", {"key": base64.b64encode(bad.encode()).decode()})
        assert [b["name"] for b in store.boxes()] == ["a"]
        assert [lease.device for lease in store.allocate("vm1", box="a")] == ["a/d0"]
    finally:
        store.close()


@pytest.mark.parametrize("line, why", [
    (b'{"result":{"events":[{"type":"PUT","kv":{"key":"%s","value":"%s"}}]}}'
     % (b64(P + "boxes/a").encode(), b64('{"address": 7}').encode()),
     "the pool's key /dxpu/v1/boxes/a has 'address'"),
    (b'{"result":{"events":[{"kv":1}]}}', "events[0].kv: 1 is not an object"),
])
def test_a_watch_gives_up_a_stream_that_is_not_etcds_and_says_why(line, why):
    """A watch stream (etcd's JSON lines) with an event the store cannot use ends the
    iteration after the good events, with ``failed`` saying why; the store then reads
    everything again (where a bad record is named to the caller)."""
    import http.server
    import threading

    from dxpu_vfio.pool.etcd_client import EtcdClient
    from dxpu_vfio.pool.etcd_watch import Watch

    good = b'{"result":{"events":[{"type":"PUT","kv":{"key":"%s","value":"%s","mod_revision":"3"}}]}}' % (
        b64(P + "boxes/b").encode(), b64(json.dumps(BOX)).encode())

    class Stream(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for data in (b'{"result":{"created":true}}\n', good + b"\n", line + b"\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = EtcdClient([f"http://127.0.0.1:{server.server_address[1]}"], timeout=2.0, prefix=P)
    try:
        watch = Watch(client, b64(P + "boxes/"), b64(P + "boxes0"), 1, P)
        batches = list(watch)
        assert [[e["kv"]["record"] for e in b] for b in batches] == [[BOX]]  # the good event, then the end
        assert watch.failed and why in watch.failed
    finally:
        client.close()
        server.shutdown()
        server.server_close()
