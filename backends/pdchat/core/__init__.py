"""Plain, typed core of pdchat: no Triton imports here, so it runs in unit tests."""
