"""The float16 audit's internals (:func:`lossscale.torch.audit`; its public names are
re-exported by :mod:`lossscale.torch`): ``run`` the entry point, ``auditor`` its runs,
``watch`` and ``ops`` what sees each operator and autograd node, ``scales`` the range,
``plan`` and ``file`` the plan, ``result`` the answer, ``_testing`` its test models."""
