"""Prefix affinity: a conversation's next turn goes where its prefix went, unless that server
is too busy; tenants and tools key apart; the table ages and stays bounded."""

from pdchat.clients.affinity import PrefixAffinity, prefix_keys


def turn(n, **fields):
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(n):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return {"messages": messages + [{"role": "user", "content": f"q{n}"}], **fields}


def test_a_next_turn_shares_the_keys_of_this_turns_messages():
    one, two = prefix_keys(turn(1)), prefix_keys(turn(2))
    assert len(two) == len(one) + 2 and two[: len(one)] == one
    assert prefix_keys(turn(1, cache_salt="b"))[0] != one[0], "another tenant shares nothing"
    assert prefix_keys(turn(1, tools=[{"type": "function"}]))[0] != one[0]


def test_conversations_stick_to_their_server_and_new_ones_go_to_the_least_loaded():
    affinity = PrefixAffinity()
    homes = {}
    for name in ("x", "y"):
        homes[name] = affinity.choose(prefix_keys(turn(0, cache_salt=name)), {"a": 0, "b": 1 if name == "x" else 0})
    assert homes["x"] == "a", "nothing cached anywhere: the least loaded"
    for n in range(1, 4):  # later turns go home, even while home is a little busier
        for name, home in homes.items():
            assert affinity.choose(prefix_keys(turn(n, cache_salt=name)), {"a": 0, "b": 0} | {home: 1}) == home
    assert affinity.matched_messages > 0.5 * affinity.routed_messages


def test_a_server_too_far_above_the_least_loaded_loses_the_request():
    affinity = PrefixAffinity(max_extra_load=2)
    keys = prefix_keys(turn(2))
    home = affinity.choose(keys, {"a": 0, "b": 0})
    other = "b" if home == "a" else "a"
    assert affinity.choose(keys, {home: 2, other: 0}) == home
    assert affinity.choose(keys, {home: 3, other: 0}) == other


def test_entries_age_out_and_a_server_that_lost_its_cache_is_forgotten():
    now = [0.0]
    affinity = PrefixAffinity(ttl_s=10, clock=lambda: now[0])
    keys = prefix_keys(turn(2))
    home = affinity.choose(keys, {"a": 0, "b": 0})
    now[0] = 5
    assert affinity.choose(keys, {"a": 0, "b": 0} | {home: 1}) == home
    now[0] = 30
    before = affinity.matched_messages
    affinity.choose(keys, {"a": 0, "b": 0})
    assert affinity.matched_messages == before, "aged out: nothing matched"
    affinity.forget("a")
    affinity.forget("b")
    assert affinity._seen == {}


def test_the_table_is_bounded():
    affinity = PrefixAffinity(max_entries=50)
    for i in range(200):
        affinity.choose(prefix_keys(turn(1, cache_salt=str(i))), {"a": 0})
    assert len(affinity._seen["a"]) == 50
