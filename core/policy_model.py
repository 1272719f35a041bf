"""The registered policy's models-from-code file (``mlflow.pyfunc.save_model(python_model=<this file>)``): MLflow
runs it to build the pyfunc when the version is loaded, so a registered version is code and weights as files, and
loading it unpickles nothing. It is saved beside the ``core`` package (the version's ``code_paths``)."""

from mlflow.models import set_model

from sage_grpo.core.registry import VideoPolicyModel

set_model(VideoPolicyModel())
