"""A front told each request's tenant salts its cache per tenant and groups its KV share."""

import pytest

from pdchat.clients.tenancy import MAX_TENANT_BYTES, MissingTenant, kv_owner, salted, tenant_of


def test_no_tenant_header_leaves_the_body_and_makes_each_call_its_own_owner():
    body = {"messages": [], "cache_salt": "mine"}
    assert tenant_of(["acme"], None) is None
    assert salted(body, None) is body
    assert kv_owner(None) != kv_owner(None)


def test_a_tenant_gets_a_salt_of_its_own_which_its_client_salt_splits_further():
    acme, other = salted({}, "acme")["cache_salt"], salted({}, "other")["cache_salt"]
    assert acme != other and acme == salted({"cache_salt": ""}, "acme")["cache_salt"]
    split = salted({"cache_salt": "team-1"}, "acme")["cache_salt"]
    assert split not in (acme, salted({"cache_salt": "team-1"}, "other")["cache_salt"])
    # A client cannot pick the salt another tenant gets: it is a digest, never the client's text.
    assert salted({"cache_salt": acme}, "other")["cache_salt"] != acme


def test_a_salt_that_is_no_string_is_left_for_the_parser_to_refuse_by_name():
    assert salted({"cache_salt": 5}, "acme")["cache_salt"] == 5


def test_a_null_salt_is_salted_as_an_absent_one():
    """The red team's `"cache_salt": null`: left as it was, the parser read it as no salt, the
    cache every client shares."""
    assert salted({"cache_salt": None}, "acme")["cache_salt"] == salted({}, "acme")["cache_salt"]


def test_one_tenant_is_one_owner():
    assert kv_owner("acme") == kv_owner("acme") != kv_owner("other")


@pytest.mark.parametrize("values", [[], [""], ["   "], ["x" * (MAX_TENANT_BYTES + 1)], ["alice", "mallory"]])
def test_a_request_without_one_usable_tenant_is_refused_naming_the_header(values):
    with pytest.raises(MissingTenant, match="'X-Tenant' once"):
        tenant_of(values, "X-Tenant")


def test_the_tenant_is_its_header_s_value_trimmed():
    assert tenant_of([" acme "], "X-Tenant") == "acme"
