from onceq import Admin, Message, Producer, PullConsumer, PullStatus


async def test_send_pull_roundtrip(addr):
    async with Admin(addr) as admin:
        await admin.create_topic("T", 2)
    async with Producer(addr) as p:
        r = await p.send("T", Message(b"hello", tags="a", keys="k1 k2", properties={"x": "1"}))
        assert r.offset == 0
    async with PullConsumer(addr, "g") as c:
        res = await c.pull("T", r.queue_id, 0, 10)
        assert res.status == PullStatus.FOUND
        (m,) = res.messages
        assert (m.body, m.tags, m.key_list, m.properties) == (b"hello", "a", ["k1", "k2"],
                                                              {"x": "1"})
        assert m.unique_key == r.unique_key
