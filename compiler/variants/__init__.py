"""Variants: the fused fp32 graph rewritten once per recipe (fp16 regions, int8/fp8 Q/DQ, the cpu's dynamic int8),
each measured against fp32. `stage.build_variants` is the stage; the modules beside it are its steps."""
