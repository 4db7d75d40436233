// An elementwise map (ir::Op::Map), rendered by codegen-cuda (`KernelKey::Map`) into the body
// of its `extern "C"` kernel: {loads} reads element i of every input into `float x0, x1, ...`
// (a vector input broadcast over rows reads element i % COLS), {expr} is the op's expression
// as C (ir::scalar::Scalar::to_cuda), computed in f32. grid: ceil(n / 256), block: 256.
const long i = elem();
if (i < n) {
{loads}  out[i] = {expr};
}
