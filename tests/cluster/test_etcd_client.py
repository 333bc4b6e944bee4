"""The etcd client (syncd.cluster.etcd) against a real etcd: leases, keys, the election service (campaign, leader,
observe, resign; a later leader's term is higher; a withdrawn campaign leaves the queue); errors that name the
endpoint; and hostile replies from a fake etcd, each refused with a named error."""

from __future__ import annotations

import asyncio

import pytest

from syncd.cluster.errors import EtcdError, EtcdProtocolError, EtcdUnavailable, LeaseNotFound
from syncd.cluster.etcd import EtcdClient
from bench.netsim import free_port

pytestmark = [pytest.mark.integration]


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_leases_and_keys(etcd):
    async def main():
        c = EtcdClient(etcd.url, timeout_s=2)
        lease = await c.grant(1)
        assert lease.ttl == 2, "etcd raises a TTL under its minimum to 2 s"
        assert await c.keepalive(lease.id) == 2
        rev = await c.put(b"t/members/000001", b"one", lease=lease.id)
        await c.put(b"t/other", b"x")
        kvs = await c.range_prefix(b"t/members/")
        assert [(kv.key, kv.value, kv.lease) for kv in kvs] == [(b"t/members/000001", b"one", lease.id)]
        assert kvs[0].create_revision == rev and c.revision >= rev and c.cluster_id
        await c.revoke(lease.id)
        assert await c.keepalive(lease.id) == 0, "a revoked lease is gone"
        assert await c.range_prefix(b"t/members/") == [], "its keys went with it"
        await c.revoke(lease.id)  # revoking it again is no error

    run(main())


def test_campaign_leader_observe_resign(etcd):
    async def main():
        c = EtcdClient(etcd.url, timeout_s=2)
        name = b"t/controller"
        assert await c.leader(name) == (None, c.revision), "nobody leads yet"
        a, b, x = [await c.grant(30) for _ in range(3)]
        won_a = await c.campaign(name, a.id, b"A")
        kv, rev = await c.leader(name)
        assert (kv.value, kv.create_revision, kv.lease) == (b"A", won_a.rev, a.id) and rev >= won_a.rev
        assert (await c.campaign(name, a.id, b"A")).rev == won_a.rev, "standing again with the same lease: same key"
        seen = []

        async def watch():
            async for kv in c.observe(name):
                seen.append((kv.value, kv.create_revision))

        watcher = asyncio.create_task(watch())
        pending_b = asyncio.create_task(c.campaign(name, b.id, b"B"))
        pending_x = asyncio.create_task(c.campaign(name, x.id, b"X"))
        await asyncio.sleep(0.5)
        assert not pending_b.done() and not pending_x.done(), "a campaign waits while another leads"
        pending_x.cancel()  # withdrawn: etcd deletes its candidate key
        await asyncio.gather(pending_x, return_exceptions=True)
        await c.resign(won_a)
        won_b = await asyncio.wait_for(pending_b, 5)
        assert won_b.rev > won_a.rev, "a later leader has a higher term"
        await c.revoke(b.id)  # the leader's lease goes: nobody is left (X withdrew)
        for _ in range(50):
            if (await c.leader(name))[0] is None:
                break
            await asyncio.sleep(0.1)
        assert (await c.leader(name))[0] is None, "the withdrawn campaign is not in the queue"
        await asyncio.sleep(0.3)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        assert seen[:2] == [(b"A", won_a.rev), (b"B", won_b.rev)]
        with pytest.raises(LeaseNotFound, match=etcd.url):
            await c.campaign(name, b.id, b"B")

    run(main())


def test_errors_name_the_endpoint(etcd):
    async def main():
        dead = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(EtcdUnavailable, match=dead.replace(".", r"\.")):
            await EtcdClient(dead, timeout_s=1).grant(5)
        both = EtcdClient(f"{dead},{etcd.url}", timeout_s=1)
        assert (await both.grant(5)).ttl == 5, "a dead endpoint is skipped for the next"
        assert both.endpoints[both._good].url == etcd.url
        with pytest.raises(ValueError, match="not http"):
            EtcdClient("etcd.example:2379")
        with pytest.raises(ValueError):
            EtcdClient("http://a:99999")

    run(main())


# ------------------------------------------------------------------------------------- hostile replies

class FakeEtcd:
    """Answers every request with ``reply`` (bytes), or never answers (None)."""

    def __init__(self, reply: bytes | None):
        self.reply = reply

    async def __aenter__(self):
        self.srv = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.srv.close()

    async def handle(self, reader, writer):
        try:
            await reader.readuntil(b"\r\n\r\n")
            if self.reply is None:
                await asyncio.sleep(30)
            writer.write(self.reply)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def http(body: bytes, status: str = "200 OK", headers: str | None = None) -> bytes:
    head = headers if headers is not None else f"Content-Length: {len(body)}\r\n"
    return f"HTTP/1.1 {status}\r\n{head}\r\n".encode() + body


GOOD_HEADER = b'"header":{"cluster_id":"1","revision":"7"}'
HOSTILE = [
    (b"SSH-2.0-OpenSSH\r\n\r\n", EtcdProtocolError, "not an HTTP reply"),
    (http(b"", headers="Content-Length: 99999999999\r\n"), EtcdProtocolError, "over the bound"),
    (http(b"x" * 100, headers="X: " + "y" * 10000 + "\r\n"), EtcdProtocolError, "over 8192 bytes"),
    (http(b"", headers="".join(f"H{i}: v\r\n" for i in range(100))), EtcdProtocolError, "too many"),
    (http(b"{not json"), EtcdProtocolError, "not valid JSON"),
    (http(b"[" * 5000), EtcdProtocolError, "deeper"),
    (http(b'{"ID": 1.5, "TTL": "5"}'), EtcdProtocolError, "non-integer"),
    (http(b'{"ID": "12", "TTL": "5", "TTL": "6"}'), EtcdProtocolError, "duplicate"),
    (http(b'{"ID": "-3", "TTL": "5"}'), EtcdProtocolError, "'ID' is not an integer"),
    (http(b'{"ID": "12", "TTL": "999999999999999999999999"}'), EtcdProtocolError, "'TTL' is not an integer"),
    (http(b'{"ID": true, "TTL": "5"}'), EtcdProtocolError, "'ID' is not an integer"),
    (http(b"zz\r\n", headers="Transfer-Encoding: chunked\r\n"), EtcdProtocolError, "chunk size"),
    (http(b"ffffff\r\n", headers="Transfer-Encoding: chunked\r\n"), EtcdProtocolError, "a chunk of"),
    (http(b"5\r\n{}", headers="Transfer-Encoding: chunked\r\n"), EtcdUnavailable, "cut short"),
    (http(b'{"ID": "12"', headers="Content-Length: 40\r\n"), EtcdUnavailable, "cut short"),
    (http(b'{"error":"etcdserver: too many requests","code":8}', status="429 Too Many"), EtcdError,
     "too many requests"),
    (http(b'{"error":"etcdserver: request timed out","code":14}', status="503 X"), EtcdUnavailable, "timed out"),
    (None, EtcdUnavailable, "no answer within"),
]


@pytest.mark.parametrize("reply,exc,what", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_replies_are_refused_with_named_errors(reply, exc, what):
    async def main():
        async with FakeEtcd(reply) as fake:
            with pytest.raises(exc, match=what) as got:
                await EtcdClient(fake.url, timeout_s=0.5).grant(5)
            assert fake.url in str(got.value), "the error names the endpoint"

    run(main())


@pytest.mark.parametrize("body,what", [
    (b'{"kvs": [{"key": "!!!", "value": ""}]}', "not valid base64"),
    (b'{"kvs": [{"key": "b3V0c2lkZQ==", "value": ""}]}', "outside the prefix"),
    (b'{"kvs": {"key": 1}}', "not a list"),
    (b'{"kvs": [{"key": "dC9h", "create_revision": "x"}]}', "create_revision"),
], ids=["base64", "outside", "kvs-type", "revision"])
def test_hostile_range_replies(body, what):
    async def main():
        async with FakeEtcd(http(body)) as fake:
            with pytest.raises(EtcdProtocolError, match=what):
                await EtcdClient(fake.url, timeout_s=0.5).range_prefix(b"t/")

    run(main())


@pytest.mark.parametrize("body,what", [
    (b'{' + GOOD_HEADER + b',"leader":{"name":"eA==","key":"eC8x","rev":"9","lease":"5"}}', "another election"),
    (b'{' + GOOD_HEADER + b',"leader":{"name":"dC9j","key":"dC9jLzE=","rev":"0","lease":"5"}}', "'rev'"),
    (b'{' + GOOD_HEADER + b'}', "'leader' is missing"),
], ids=["other-election", "rev-zero", "missing"])
def test_hostile_campaign_replies(body, what):
    async def main():
        async with FakeEtcd(http(body)) as fake:
            with pytest.raises(EtcdProtocolError, match=what):
                await EtcdClient(fake.url, timeout_s=0.5).campaign(b"t/c", 5, b"v")

    run(main())
