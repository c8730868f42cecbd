"""Test-time adaptation methods as plain-PyTorch plug-ins (source, BN-1, Tent, ETA/EATA, RDumb,
LCoTTA), the gradient-subspace kernel of LCoTTA, and analysis helpers for its claims.

No engine code here: a fedsim learner wraps a method, feeds it the client's test stream batch by
batch, stores ``method.state_dict()`` in the node's ``RecordDict`` between rounds and sends
``method.shared_state()`` (the norm affine parameters) to the server.
"""

from clients.tta.methods import (  # noqa: F401
    TTA_METHODS,
    BNAdapt,
    BNAdaptParams,
    EATAParams,
    ETA,
    LCoTTA,
    LCoTTAParams,
    RDumb,
    RDumbParams,
    Source,
    SourceParams,
    Tent,
    TentParams,
    TTAMethod,
    build_method,
    make_params,
    softmax_entropy,
)
from clients.tta.norm import (  # noqa: F401
    collect_norm_params,
    configure_norm,
    load_norm_state,
    norm_dim,
    norm_state,
)
from clients.tta.subspace import GradientWindow, principal_subspace, project  # noqa: F401
