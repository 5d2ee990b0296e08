// sdfarm: a job's images sampled together (included into stable-diffusion.cpp right before
// generate_image, where the generation's types are defined).
//
// The runtime samples a job's batch_count images one after another: every step of every image
// is its own UNet call over one latent. On a GPU a UNet call over one 512x512 latent is
// thousands of small kernels, each far from filling the device, so the images of a job go
// through the UNet together here: their latents stacked on ggml's batch axis (dim 3; the UNet
// repeats the text context over it), one sampling run, then split again and decoded one by one
// as before.
//
// Each image stays the image its own seed makes alone. Its starting noise is drawn from a
// generator seeded with seed + b, as the one-by-one loop draws it, and the sampler's noise (the
// ancestral samplers') comes from SdfarmBatchRNG, which draws every image's share from that
// image's own generator. On the CPU backend every kernel computes each image's values as it does
// for one image alone, so the pixels are the same (tests/e2e/test_batch_sampling.py); on CUDA
// cuBLAS rounds a batched product otherwise, by at most 1/255 on the H200 (docs/gpu.md).
//
// Only where nothing else in the call is per image or unsure of a batch: a UNet model, text to
// image (no init image, ControlNet, reference images, PhotoMaker, concat latent or image
// condition; the all-ones denoise mask of one image broadcasts over the batch), no step
// cache, no hires pass and no previews. SDFARM_BATCH_SAMPLING=0 in the
// process's environment samples one by one as the runtime does.

#include <cstdlib>

// The sampler's noise of a batch: randn(n) over the stacked latents is each image's own
// generator's randn(n / images), in image order, which is the layout of the stacked tensor
// (the batch is its outermost axis).
class SdfarmBatchRNG : public RNG {
public:
    explicit SdfarmBatchRNG(std::vector<std::shared_ptr<RNG>> rngs)
        : rngs_(std::move(rngs)) {}

    void manual_seed(uint64_t) override {}  // each image's generator is seeded already

    std::vector<float> randn(uint32_t n) override {
        const uint32_t images = (uint32_t)rngs_.size();
        GGML_ASSERT(images > 0 && n % images == 0);
        std::vector<float> out;
        out.reserve(n);
        for (auto & rng : rngs_) {
            std::vector<float> part = rng->randn(n / images);
            out.insert(out.end(), part.begin(), part.end());
        }
        return out;
    }

private:
    std::vector<std::shared_ptr<RNG>> rngs_;
};

// A fresh generator of the same kind as `rng` (nullptr for a kind we do not know: the caller
// then samples one by one).
static std::shared_ptr<RNG> sdfarm_rng_like(const std::shared_ptr<RNG> & rng) {
    if (std::dynamic_pointer_cast<PhiloxRNG>(rng)) {
        return std::make_shared<PhiloxRNG>();
    }
    if (std::dynamic_pointer_cast<MT19937RNG>(rng)) {
        return std::make_shared<MT19937RNG>();
    }
    if (std::dynamic_pointer_cast<STDDefaultRNG>(rng)) {
        return std::make_shared<STDDefaultRNG>();
    }
    return nullptr;
}

// A latent-sized tensor of one image ([W, H, C, 1]), which broadcasts over the stacked batch;
// text to image has an all-ones denoise mask of that shape, so it may be present.
static bool sdfarm_one_image(const sd::Tensor<float> & t) {
    return t.empty() || (t.dim() == 4 && t.shape()[3] == 1);
}

static bool sdfarm_batch_sampling_on() {
    const char * v = std::getenv("SDFARM_BATCH_SAMPLING");
    return v == nullptr || v[0] != '0';
}

// Puts the sampler's generator back however the batched run ends.
struct SdfarmSamplerRngSwap {
    std::shared_ptr<RNG> & slot;
    std::shared_ptr<RNG> kept;
    SdfarmSamplerRngSwap(std::shared_ptr<RNG> & s, std::shared_ptr<RNG> with)
        : slot(s), kept(s) {
        slot = std::move(with);
    }
    ~SdfarmSamplerRngSwap() { slot = kept; }
};

// 1: the batch was sampled together into `final_latents`; 0: not taken (the caller samples one
// by one); -1: sampling failed (the caller fails the call as its own loop does).
static int sdfarm_batch_sample(sd_ctx_t * sd_ctx,
                               const sd_img_gen_params_t * params,
                               const GenerationRequest & request,
                               const SamplePlan & plan,
                               const ImageGenerationLatents & latents,
                               const ImageGenerationEmbeds & embeds,
                               std::vector<sd::Tensor<float>> & final_latents) {
    StableDiffusionGGML * sd = sd_ctx->sd;
    const int images = request.batch_count;
    const bool plain = images > 1 && sdfarm_batch_sampling_on() &&
                       sd_version_is_unet(sd->version) && params->init_image.data == nullptr &&
                       sdfarm_one_image(latents.init_latent) &&
                       latents.concat_latent.empty() && latents.control_image.empty() &&
                       latents.ref_latents.empty() && sdfarm_one_image(latents.denoise_mask) &&
                       embeds.id_cond.c_crossattn.empty() && !request.use_img_cond &&
                       !request.hires.enabled &&
                       (request.cache_params == nullptr ||
                        request.cache_params->mode == SD_CACHE_DISABLED) &&
                       (sd_get_preview_callback() == nullptr ||
                        sd_get_preview_mode() == PREVIEW_NONE);
    if (!plain) {
        return 0;
    }
    const bool shared = sd->sampler_rng == sd->rng;  // one generator: the sampler's draws follow
                                                     // the starting noise's, image by image
    std::vector<std::shared_ptr<RNG>> samplers;
    sd::Tensor<float> noise;
    sd::Tensor<float> init;  // the starting latent once per image: the sampler asks for the
                             // same element count as the noise (denoiser's noise_scaling)
    for (int b = 0; b < images; b++) {
        const int64_t seed = request.seed + b;
        std::shared_ptr<RNG> rng = sdfarm_rng_like(sd->rng);
        std::shared_ptr<RNG> sampler = shared ? rng : sdfarm_rng_like(sd->sampler_rng);
        if (rng == nullptr || sampler == nullptr) {
            return 0;
        }
        rng->manual_seed(seed);
        if (!shared) {
            sampler->manual_seed(seed);
        }
        sd::Tensor<float> one = sd::randn_like<float>(latents.init_latent, rng);
        noise = b == 0 ? std::move(one) : sd::ops::concat(noise, one, 3);
        init  = b == 0 ? latents.init_latent : sd::ops::concat(init, latents.init_latent, 3);
        samplers.push_back(sampler);
    }
    LOG_INFO("sampling %d images together - seeds %" PRId64 "..%" PRId64, images, request.seed,
             request.seed + images - 1);
    const int64_t start = ggml_time_ms();
    sd::Tensor<float> x_0;
    {
        SdfarmSamplerRngSwap swap(sd->sampler_rng, std::make_shared<SdfarmBatchRNG>(samplers));
        x_0 = sd->sample(sd->diffusion_model,
                         true,
                         init,
                         std::move(noise),
                         embeds.cond,
                         embeds.uncond,
                         embeds.img_cond,
                         embeds.id_cond,
                         latents.control_image,
                         request.control_strength,
                         request.guidance,
                         plan.eta,
                         request.shifted_timestep,
                         plan.sample_method,
                         sd->is_flow_denoiser(),
                         plan.sigmas,
                         plan.start_merge_step,
                         latents.ref_latents,
                         request.increase_ref_index,
                         latents.denoise_mask,
                         sd::Tensor<float>(),
                         1.f,
                         request.cache_params);
    }
    if (x_0.empty() || x_0.dim() != 4 || x_0.shape()[3] != images) {
        LOG_ERROR("sampling %d images together failed after %.2fs", images,
                  (ggml_time_ms() - start) * 1.0f / 1000);
        return -1;
    }
    for (int b = 0; b < images; b++) {
        final_latents.push_back(sd::ops::slice(x_0, 3, b, b + 1));
    }
    LOG_INFO("sampling completed, taking %.2fs", (ggml_time_ms() - start) * 1.0f / 1000);
    return 1;
}
