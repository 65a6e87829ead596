"""The API process's imports (jaxserve serve's front process): never jax; transformers'
tokenizer classes pre-imported while the engine core loads (engine.core_client)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_api_process_imports_the_tokenizer_library_early_but_never_jax():
    """The API process's client module imports neither jax nor transformers; the pre-import
    (run while the core loads) brings transformers' tokenizer classes in, still without jax."""
    code = ("import sys; import jaxserve.engine.core_client as c; "
            "a = ('jax' in sys.modules, 'transformers' in sys.modules); "
            "c.preimport_tokenizer_library(); "
            "print(*a, 'jax' in sys.modules, "
            "any(m.startswith('transformers.tokenization_utils') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.stdout.split() == ["False", "False", "False", "True"], out.stderr
