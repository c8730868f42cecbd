
from central import paretoq  # noqa: F401
from central import omnidraft  # noqa: F401
from central import lrqk  # noqa: F401
from central import watermark  # noqa: F401
from central import spam_select  # noqa: F401
from central import pnn_ident  # noqa: F401
from central import lasq  # noqa: F401
from central import panlut  # noqa: F401
from central import deft  # noqa: F401
from central import tensor_compress  # noqa: F401
from central import combo  # noqa: F401
from central import clic  # noqa: F401
from central import peft_meta  # noqa: F401
