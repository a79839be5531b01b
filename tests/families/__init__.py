"""Model families that live in the tests: each registered with one line of OMNISTAGE_FAMILIES."""
