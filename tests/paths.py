"""Where the tests find the repository, the shared reference models and the helper modules."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))     # on sys.path (conftest): the helpers live here
REPO = os.path.dirname(TESTS)
REFERENCE_MODELS = os.path.join(os.path.dirname(REPO), "shared", "reference-models")
