"""The application of deploy.yaml with the fake engine in place of the model: what the
autoscaling integration test deploys through Serve's config path (an `import_path`)."""

from deploy.app import compose_app
from deploy.config import AppArgs
from tests.deploy.fakes import fake_engine_factory


def build_fake_app(args: dict):
    return compose_app(AppArgs.model_validate(args), fake_engine_factory)
