//! NVRTC: generated CUDA C to PTX, without the CUDA toolkit (only the NVRTC library, found
//! through the dynamic loader's path: `LD_LIBRARY_PATH`).

use crate::CodegenError;

/// Compiles `source` to PTX for `arch` (`compute_90`, ...). A missing NVRTC library, or a
/// source NVRTC rejects, is an error that says so (with NVRTC's log).
pub fn compile_ptx(source: &str, arch: &'static str) -> Result<String, CodegenError> {
    let opts =
        cudarc::nvrtc::CompileOptions { arch: Some(arch), options: vec!["-std=c++17".into()], ..Default::default() };
    let src = source.to_string();
    // cudarc panics when it cannot load the library; turn that into an error.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(move || cudarc::nvrtc::compile_ptx_with_opts(src, opts));
    std::panic::set_hook(hook);
    match result {
        Ok(Ok(ptx)) => Ok(ptx.to_src()),
        Ok(Err(e)) => Err(CodegenError::Unsupported(format!("NVRTC rejected the generated source: {e:?}"))),
        Err(_) => Err(CodegenError::Unsupported(
            "the NVRTC library (libnvrtc.so) was not found: install the CUDA toolkit, or \
             `pip install nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH \
             (scripts/nvrtc.sh prints one)"
                .into(),
        )),
    }
}
