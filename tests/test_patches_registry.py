from hf_memo.patches.registry import TESTED_MODEL_TYPES, supported_model_types
from tests.conftest import FAMILIES
from tests.model_catalog import CATALOG


def test_the_tested_model_types_are_those_the_tests_build_sorted():
    """Every model type listed as proven is built by the tests that compare every mode with the unpatched model: the
    catalog's (tests/test_patches_structure.py) and the first five families' (tests/test_patches_forwards*.py)."""
    assert supported_model_types() == sorted(TESTED_MODEL_TYPES)
    catalog = {entry.config().model_type for entry in CATALOG.values()}
    assert catalog | set(FAMILIES) == set(TESTED_MODEL_TYPES)
