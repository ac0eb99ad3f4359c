//! `[rollout]`: the stage each DeviceClass's devices start in.
//!
//! ```toml
//! [rollout.class]
//! "shareguard-net-bandwidth" = "observe"   # every device of the class starts observed
//! ```
//!
//! A device's own `stage` wins over its class's; a stage set at run time
//! (`shareguard rollout`) wins over both, since the store keeps it. A class named here
//! but by no device of this node is allowed: one file serves every node, and another
//! node may have it.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

use crate::{
    config::slo::ErrAt,
    config::{ConfigError, check_class_name},
    rollout::Stage,
};

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRollout {
    #[serde(default)]
    class: BTreeMap<Spanned<String>, Spanned<String>>,
}

/// DeviceClass name -> the stage its devices start in, for the classes `[rollout.class]`
/// names.
pub(crate) fn parse(
    raw: Option<RawRollout>,
    err: ErrAt<'_>,
) -> Result<BTreeMap<String, Stage>, ConfigError> {
    let mut out = BTreeMap::new();
    for (class, stage) in raw.map(|r| r.class).unwrap_or_default() {
        check_class_name(class.get_ref()).map_err(|why| {
            err(
                class.span(),
                format!("rollout.class {:?}: {why}", class.get_ref()),
            )
        })?;
        let s = parse_stage(&stage, &format!("rollout.class {:?}", class.get_ref()), err)?;
        out.insert(class.into_inner(), s);
    }
    Ok(out)
}

/// A `stage` value, `observe` or `enforce`; `owner` names where it was written.
pub(crate) fn parse_stage(
    s: &Spanned<String>,
    owner: &str,
    err: ErrAt<'_>,
) -> Result<Stage, ConfigError> {
    Stage::parse(s.get_ref()).ok_or_else(|| {
        err(
            s.span(),
            format!(
                "{owner}: stage {:?} is not \"observe\" or \"enforce\"",
                s.get_ref()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use crate::{config::Config, rollout::Stage};

    fn config(extra: &str) -> Result<Config, crate::config::ConfigError> {
        Config::parse(
            &format!(
                "[[device]]\nname = \"gen-0\"\ndriver = \"d.example.com\"\npool = \"p\"\nkind = \"generic\"\n{extra}\n\
                 [device.capacity.slots]\nvalue = \"4\"\n\
                 [[device]]\nname = \"gen-1\"\ndriver = \"d.example.com\"\npool = \"p\"\nkind = \"generic\"\nclass = \"other\"\n\
                 [device.capacity.slots]\nvalue = \"4\"\n\
                 [rollout.class]\n\"shareguard-accounted\" = \"observe\"\n\"not-here\" = \"enforce\"\n"
            ),
            "t.toml",
        )
    }

    #[test]
    fn a_class_sets_the_first_stage_of_its_devices_and_a_device_its_own() {
        let c = config("").unwrap();
        assert_eq!(c.devices[0].class, "shareguard-accounted");
        assert_eq!(c.devices[0].stage, Stage::Observe);
        // Another class, not named under [rollout.class]: the default.
        assert_eq!(c.devices[1].stage, Stage::Enforce);
        // The device's own stage wins over its class's.
        let c = config("stage = \"enforce\"").unwrap();
        assert_eq!(c.devices[0].stage, Stage::Enforce);
    }

    #[test]
    fn a_bad_stage_or_class_name_is_refused_with_its_line() {
        let e = Config::parse(
            "[rollout.class]\n\"shareguard-accounted\" = \"enforced\"\n",
            "t.toml",
        )
        .unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        assert!(
            e.message
                .contains("rollout.class \"shareguard-accounted\": stage \"enforced\" is not"),
            "{e}"
        );
        let e =
            Config::parse("[rollout.class]\n\"Bad_Class\" = \"observe\"\n", "t.toml").unwrap_err();
        assert!(e.message.contains("rollout.class \"Bad_Class\""), "{e}");
        let e = Config::parse("[rollout]\nclasses = {}\n", "t.toml").unwrap_err();
        assert!(e.message.contains("classes"), "{e}");
    }
}
