"""The layering of services/ (scripts/import_graph.py): no import circles, nothing imported upward
from the ground floor (services.common), no named environment variable read outside the settings
module, no service importing the CLI (services.cli) or the launcher (services.local), the router's
load balancer never importing its front end. The checker
itself is tested first on small trees, so that a clean result means a clean tree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

ALLOWED_UPWARD: list[str] = [
    # empty: services/common (settings, errors, logging, sampling, model paths, ...) imports nothing above it
]


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


ig = _load_checker()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# ------------------------------------------------------------------------------------ the checker


def test_a_circle_through_a_lazy_or_type_checking_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/a/__init__.py": "",
            "services/a/one.py": "def f():\n    from services.a import two\n",
            "services/a/two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .three import X\n",
            "services/a/three.py": "import services.a.one\n",
            "services/a/alone.py": "from services.a import one\n",
        },
    )
    assert ig.cycles(ig.build_graph(root)) == [["services.a.one", "services.a.three", "services.a.two"]]


def test_no_circle_through_a_package_init_that_its_modules_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/a/__init__.py": "from services.a.one import f\n",
            "services/a/one.py": "import os\n\ndef f():\n    pass\n",
            "services/a/two.py": "from services.a import one\n",
        },
    )
    assert ig.cycles(ig.build_graph(root)) == []


def test_upward_imports_are_those_from_the_ground_floor_out(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/common/__init__.py": "",
            "services/common/types.py": "from services.common import errors\n",
            "services/common/errors.py": "",
            "services/common/bad.py": "def f():\n    from services.router import core\n",
            "services/common/legacy/__init__.py": "",
            "services/common/legacy/report.py": "from services.router.core import X\n",
            "services/router/__init__.py": "",
            "services/router/core.py": "from services.common.types import T\n",
        },
    )
    graph = ig.build_graph(root)
    assert [str(f) for f in ig.upward_imports(graph)] == [
        "services.common.bad:2 -> services.router.core",
        "services.common.legacy.report:1 -> services.router.core",
    ]
    assert [str(f) for f in ig.upward_imports(graph, allow=["services.common.legacy.*"])] == [
        "services.common.bad:2 -> services.router.core"
    ]


def test_named_environment_reads_are_found_and_copies_of_the_environment_are_not(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/reads.py": (
                "import os\nfrom os import environ, getenv\n"
                "a = os.environ.get('A')\nb = os.environ['B']\nc = 'C' in os.environ\nd = os.getenv('D')\n"
                "e = environ.get('E', '')\nf = getenv('F')\n"
            ),
            "services/copies.py": (
                "import os\nenv = dict(os.environ)\nenv2 = {**os.environ, 'X': '1'}\nos.environ['Y'] = '2'\n"
            ),
            "services/common/__init__.py": "",
            "services/common/config.py": "import os\nmodels = os.environ.get('MESHSERVE_MODELS_DIR')\n",
        },
    )
    assert [str(f) for f in ig.env_reads(root)] == [
        "services.reads:3 -> A",
        "services.reads:4 -> B",
        "services.reads:5 -> C",
        "services.reads:6 -> D",
        "services.reads:7 -> E",
        "services.reads:8 -> F",
    ]


def test_the_cli_and_the_launcher_are_imported_only_from_their_floor_or_above(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/cli/__init__.py": "from services.cli import up\n",
            "services/cli/up.py": "from services.local.mesh import Mesh\nfrom services.gateway import keys\n",
            "services/local/__init__.py": "",
            "services/local/mesh.py": "from services.controlplane import door\nfrom services.local import state\n",
            "services/local/state.py": "def f():\n    from services.cli import up\n",
            "services/gateway/__init__.py": "",
            "services/gateway/keys.py": "from services.local.state import recorded\n",
            "services/controlplane/__init__.py": "",
            "services/controlplane/door.py": "import services.cli\n",
            "services/common/__init__.py": "",
            "services/common/config.py": "",
        },
    )
    assert [str(f) for f in ig.top_floor_imports(ig.build_graph(root))] == [
        "services.controlplane.door:1 -> services.cli",
        "services.gateway.keys:1 -> services.local.state",
        "services.local.state:2 -> services.cli.up",
    ]
    assert ig.main(["--root", str(root)]) == 1


def test_the_routers_balancer_never_imports_its_front_end(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/router/__init__.py": "",
            "services/router/server.py": (
                "from services.router.frontend import api\nfrom services.router.balancer import core\n"
            ),
            "services/router/types.py": "",
            "services/router/frontend/__init__.py": "",
            "services/router/frontend/api.py": "from services.router.balancer.core import Router\n",
            "services/router/balancer/__init__.py": "",
            "services/router/balancer/core.py": "from services.router import types\n",
            "services/router/balancer/wake.py": "def f():\n    from services.router.frontend.api import RouterAPI\n",
        },
    )
    assert [str(f) for f in ig.part_imports(ig.build_graph(root))] == [
        "services.router.balancer.wake:2 -> services.router.frontend.api"
    ]
    assert ig.main(["--root", str(root)]) == 1


def test_the_command_exits_1_on_a_finding_and_0_on_a_clean_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clean = _tree(tmp_path / "clean", {"services/__init__.py": "", "services/a.py": "from services import b\n"})
    _tree(clean, {"services/b.py": ""})
    assert ig.main(["--root", str(clean)]) == 0
    dirty = _tree(tmp_path / "dirty", {"services/__init__.py": "", "services/a.py": "import os\nos.getenv('X')\n"})
    assert ig.main(["--root", str(dirty)]) == 1
    assert "services.a:2 -> X" in capsys.readouterr().out


# -------------------------------------------------------------------------------- the real tree


@pytest.fixture(scope="module")
def graph() -> dict[str, list[object]]:
    return ig.build_graph(ROOT)


def test_services_has_no_import_circle(graph: dict[str, list[object]]) -> None:
    found = ig.cycles(graph)
    assert found == [], "import circles: break them where the purposes part"


def test_the_ground_floor_imports_nothing_above_it(graph: dict[str, list[object]]) -> None:
    upward = [str(f) for f in ig.upward_imports(graph, allow=ALLOWED_UPWARD)]
    assert upward == [], "services.common imports from a package above it; move the shared piece down"


def test_no_service_imports_the_cli_or_the_launcher(graph: dict[str, list[object]]) -> None:
    found = [str(f) for f in ig.top_floor_imports(graph)]
    assert found == [], "a service imports services.cli or services.local; move what it needs below the services"


def test_no_module_outside_the_settings_module_reads_a_named_environment_variable() -> None:
    reads = [str(f) for f in ig.env_reads(ROOT)]
    assert reads == [], "read it through a settings class of services/common/config.py (or a service's config)"


def test_no_lower_part_of_a_service_imports_its_upper_part(graph: dict[str, list[object]]) -> None:
    found = [str(f) for f in ig.part_imports(graph)]
    assert found == [], (
        "the router's balancer imports its front end; move the shared piece to the balancer or the router's root"
    )
