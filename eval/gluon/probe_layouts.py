import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])

@gluon.jit
def k(x_ptr):
    gl.static_print(gl.to_linear_layout(gl.DotOperandLayout(1, MMA, 2), [128, 64]))
    gl.static_print(gl.to_linear_layout(gl.DotOperandLayout(0, MMA, 2), [16, 64]))
    gl.static_print(gl.to_linear_layout(MMA, [16, 64]))
    gl.static_print(gl.to_linear_layout(gl.DotOperandLayout(1, MMA, 2), [64, 128]))

src = GluonASTSource(k, {"x_ptr": "*i32"}, {})
triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
