"""What test modules import: paths, data and builders shared by several test folders.

Imported one way, absolutely: ``from tests.helpers.repo import EXAMPLES``, ``from tests.helpers import
fleet_harness as h``. Fixtures are not here: pytest finds those in the ``conftest.py`` of the folder that
uses them or of a folder above it. The helpers' own ``assert``\\ s are rewritten as a test module's are, so
a failing one shows its values.
"""

import pkgutil

import pytest

pytest.register_assert_rewrite(*(f"{__name__}.{module.name}" for module in pkgutil.iter_modules(__path__)))
