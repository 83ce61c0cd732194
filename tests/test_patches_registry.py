from hf_memo.patches.registry import TESTED_MODEL_TYPES, TESTED_OUTSIDE_CATALOG, supported_model_types
from tests.conftest import FAMILIES
from tests.model_catalog import CATALOG


def test_the_tested_model_types_are_those_the_tests_build_sorted():
    """Every model type listed as proven is built by the tests that compare every mode with the unpatched model: the
    catalog's (tests/test_patches_structure.py) and the first five families' (tests/test_patches_forwards*.py)."""
    catalog = {entry.config().model_type for entry in CATALOG.values()}
    assert catalog | set(FAMILIES) == set(TESTED_MODEL_TYPES)


def test_model_types_outside_the_catalog_are_those_the_self_check_tests_build_in_the_modes_they_pass():
    """tests/test_patches_self_check.py builds them in every mode: exact, or refused under memo with the cause."""
    from tests.test_patches_self_check import FAMILIES, MEMO_REFUSALS, _build

    built = {_build(name).config.model_type: name for name in FAMILIES}
    assert set(built) == set(TESTED_OUTSIDE_CATALOG)
    for model_type, modes in TESTED_OUTSIDE_CATALOG.items():
        assert ("memo" in modes) == all(
            n not in MEMO_REFUSALS for n in FAMILIES if _build(n).config.model_type == model_type
        )
    every_mode = [t for t, modes in TESTED_OUTSIDE_CATALOG.items() if "memo" in modes]
    assert supported_model_types() == sorted({*TESTED_MODEL_TYPES, *every_mode})
    assert set(supported_model_types("full")) == {*TESTED_MODEL_TYPES, *TESTED_OUTSIDE_CATALOG}
